"""Stands in for aiohttp_cors, which only the dashboard's HTTP servers use: Ray reads its absence as a minimal install."""

raise ModuleNotFoundError("aiohttp_cors is hidden from this Ray process by mindrl (ray_daemons)", name="aiohttp_cors")

"""Put first on the path of the processes a private Ray starts (`ray_daemons.minimal_dashboard_agent`): the packages
here hide Ray's optional dashboard dependencies from them, so its dashboard agent runs in minimal mode."""

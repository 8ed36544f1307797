"""A process tree's memory for the benchmarks: each process's role (the driver, a Ray actor's class, Ray's daemons)
and the tree's peak RSS / PSS / USS, in total and per role, sampled with psutil."""

from __future__ import annotations

import os
import threading
import time
from dataclasses import asdict, dataclass

# Roles a process may still leave: a Ray worker is "ray worker (starting)" until it sets its title, then "IDLE"
# until an actor claims it.
TRANSIENT_ROLES = ("ray worker (starting)", "IDLE", "ray worker")


def role_of(name: str, cmdline: list[str], is_root: bool) -> str:
    """The role a process of the tree plays: the driver; a Ray actor by its class ("ray::IntegratedWorker.update"
    counts as IntegratedWorker); each of Ray's daemons ("ray raylet", "ray gcs_server", its Python agents by
    script: "ray agent", "ray log_monitor", ...); Python's multiprocessing helpers by kind ("multiprocessing
    forkserver", "multiprocessing resource_tracker", "multiprocessing spawn": e.g. the verifiers' pool, whose
    processes forked by the forkserver keep its command line);
    anything else as "other"."""
    if is_root:
        return "driver"
    title = cmdline[0] if cmdline else name
    if title.startswith("ray::"):
        return title[len("ray::") :].split(".", 1)[0].split(" ", 1)[0] or "ray worker"
    if name in ("raylet", "gcs_server"):  # before the worker check: the raylet's command line names default_worker.py
        return "ray " + name
    text = " ".join(cmdline) or name
    if "default_worker.py" in text:  # a worker process before setproctitle
        return "ray worker (starting)"
    # before Ray's agents: a forkserver's command line carries its parent's sys.path, which may name ray/ folders
    for kind in ("forkserver", "resource_tracker", "spawn"):
        if f"multiprocessing.{kind}" in text:
            return "multiprocessing " + kind
    if "/ray/" in text or "ray/_private" in text or "ray/dashboard" in text:  # Ray's Python agents, by script
        script = next((a for a in cmdline if a.endswith(".py")), name)
        return "ray " + os.path.basename(script).removesuffix(".py")
    return "other"


@dataclass
class RoleMemory:
    """One role's memory over a run (MiB; a role may hold several processes, summed)."""

    procs: int = 0  # the most processes seen in the role at once
    peak_rss_mb: float = 0.0  # resident pages, shared ones (torch's libraries, ...) counted in every process
    peak_pss_mb: float = 0.0  # each shared page split among the processes that map it
    peak_uss_mb: float = 0.0  # the pages only this role's processes hold: what ending them would free
    rss_at_tree_peak_mb: float = 0.0  # the role's RSS when the whole tree's summed RSS peaked


class TreeSampler:
    """Calls `sample(procs)` every `interval` seconds, on a thread of its own, with a process and all its descendants
    (psutil.Process objects, the root first) until `stop`. A subclass sets its own state before calling
    `TreeSampler.__init__`, which starts the thread."""

    def __init__(self, pid: int, interval: float = 0.5) -> None:
        self.pid, self.interval = pid, interval
        self.sampler_cpu_s = 0.0  # the sampling thread's own CPU time (reading smaps_rollup is not free)
        self._roles: dict[int, str] = {}  # pid -> role, once final (a Ray actor's title changes with its method)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def sample(self, procs: list) -> None:
        raise NotImplementedError

    def role(self, p) -> str:
        """`p`'s role (see `role_of`), kept once final; call it inside `p.oneshot()`."""
        role = self._roles.get(p.pid)
        if role is None:
            role = role_of(p.name(), p.cmdline(), p.pid == self.pid)
            if role not in TRANSIENT_ROLES:  # an actor's class is fixed once its title says it
                self._roles[p.pid] = role
        return role

    def _run(self) -> None:
        import psutil

        try:
            root = psutil.Process(self.pid)
        except psutil.NoSuchProcess:
            return
        cpu0 = time.thread_time()
        while not self._stop.is_set():
            try:
                procs = [root, *root.children(recursive=True)]
            except psutil.NoSuchProcess:
                break
            self.sample(procs)
            self.sampler_cpu_s = time.thread_time() - cpu0
            self._stop.wait(self.interval)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


class TreeMemory(TreeSampler):
    """Samples a process and all its descendants every `interval` seconds until `stop`: the peak summed RSS, PSS
    and USS of the tree, and each role's (see `role_of`). RSS sums count a page shared by k processes k times;
    PSS sums count it once, so the tree's PSS is the memory it really holds. RSS is the kernel's per-process
    counter (/proc/<pid>/statm), which may lag the page-table walk PSS and USS come from by a few MiB per thread."""

    def __init__(self, pid: int, interval: float = 0.5, shared_every: int = 4) -> None:
        # PSS / USS come from /proc/<pid>/smaps_rollup, a walk of the page tables (tens of ms for a GiB-sized
        # process), so they are read every `shared_every`-th sample; RSS (statm) at every one.
        self.shared_every = max(1, shared_every)
        self.peak_rss_mb = self.peak_pss_mb = self.peak_uss_mb = 0.0
        self.roles: dict[str, RoleMemory] = {}
        self.samples = 0
        super().__init__(pid, interval)

    def sample(self, procs: list) -> None:
        import psutil

        shared = self.samples % self.shared_every == 0
        now: dict[str, list[float]] = {}  # role -> [processes, rss, pss, uss] (bytes)
        for p in procs:
            try:
                with p.oneshot():
                    role = self.role(p)
                    m = p.memory_full_info() if shared else p.memory_info()
            except psutil.Error:  # exited between listing and reading
                continue
            acc = now.setdefault(role, [0, 0.0, 0.0, 0.0])
            acc[0] += 1
            acc[1] += m.rss
            if shared:
                acc[2] += m.pss
                acc[3] += m.uss
        mib = 2.0**20
        rss = sum(v[1] for v in now.values()) / mib
        self.peak_pss_mb = max(self.peak_pss_mb, sum(v[2] for v in now.values()) / mib)
        self.peak_uss_mb = max(self.peak_uss_mb, sum(v[3] for v in now.values()) / mib)
        tree_peak = rss > self.peak_rss_mb
        self.peak_rss_mb = max(self.peak_rss_mb, rss)
        for role, (n, r, pss, uss) in now.items():
            rm = self.roles.setdefault(role, RoleMemory())
            rm.procs = max(rm.procs, int(n))
            rm.peak_rss_mb = max(rm.peak_rss_mb, r / mib)
            rm.peak_pss_mb = max(rm.peak_pss_mb, pss / mib)
            rm.peak_uss_mb = max(rm.peak_uss_mb, uss / mib)
        if tree_peak:
            for role, rm in self.roles.items():
                rm.rss_at_tree_peak_mb = now[role][1] / mib if role in now else 0.0
        self.samples += 1

    def stop(self) -> dict:
        """Stops sampling; {peak_rss_mb, peak_pss_mb, peak_uss_mb, samples, sampler_cpu_s, by_role: {role: RoleMemory
        as a dict}}, roles by their RSS at the tree's peak, largest first."""
        super().stop()
        roles = sorted(self.roles.items(), key=lambda kv: (-kv[1].rss_at_tree_peak_mb, -kv[1].peak_rss_mb))
        return {
            "peak_rss_mb": self.peak_rss_mb,
            "peak_pss_mb": self.peak_pss_mb,
            "peak_uss_mb": self.peak_uss_mb,
            "samples": self.samples,
            "sampler_cpu_s": self.sampler_cpu_s,
            "by_role": {role: asdict(rm) for role, rm in roles},
        }


def format_roles(memory: dict, indent: str = "  ") -> list[str]:
    """Lines of a per-role table from `TreeMemory.stop()`'s dict: processes, RSS at the tree's peak, and each
    role's own peak RSS / PSS / USS (MiB)."""
    lines = [
        f"{indent}{'process (role)':<34}{'procs':>6}{'RSS@peak':>10}{'peak RSS':>10}{'peak PSS':>10}{'peak USS':>10}"
    ]
    for role, r in memory["by_role"].items():
        lines.append(
            f"{indent}{role:<34}{r['procs']:>6}{r['rss_at_tree_peak_mb']:>10.0f}{r['peak_rss_mb']:>10.0f}"
            f"{r['peak_pss_mb']:>10.0f}{r['peak_uss_mb']:>10.0f}"
        )
    lines.append(
        f"{indent}{'whole tree (peak of the sums)':<34}{'':>6}{memory['peak_rss_mb']:>10.0f}{'':>10}"
        f"{memory['peak_pss_mb']:>10.0f}{memory['peak_uss_mb']:>10.0f}"
    )
    return lines


def _phase_of(cmdline: list[str]) -> str:
    """A direct child of the measured command by what it runs: the module after `-m`, else the script, else the
    program (`mindrl.cli.train`, `general_check.py`, `tee`)."""
    if "-m" in cmdline[:-1]:
        return cmdline[cmdline.index("-m") + 1]
    script = next((a for a in cmdline[1:] if a.endswith((".py", ".sh"))), None)
    return os.path.basename(script or (cmdline[0] if cmdline else "?"))


class PhaseMemory:
    """The peak summed RSS of each direct child's subtree of `pid` (a recipe's steps, one after another), with the
    parent's own RSS added: what the tree held while that step ran. Sampled every `interval` seconds."""

    def __init__(self, pid: int, interval: float = 0.5) -> None:
        self.pid, self.interval = pid, interval
        self.peaks: dict[str, float] = {}  # phase -> peak RSS (MiB)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import psutil

        try:
            root = psutil.Process(self.pid)
        except psutil.NoSuchProcess:
            return
        while not self._stop.is_set():
            try:
                own, children = root.memory_info().rss, root.children()
            except psutil.NoSuchProcess:
                break
            now: dict[str, float] = {}
            for child in children:
                try:
                    phase = _phase_of(child.cmdline())
                    rss = sum(p.memory_info().rss for p in [child, *child.children(recursive=True)])
                except psutil.Error:
                    continue
                now[phase] = now.get(phase, 0.0) + rss
            for phase, rss in now.items():
                if phase != "tee":
                    self.peaks[phase] = max(self.peaks.get(phase, 0.0), (own + rss) / 2.0**20)
            self._stop.wait(self.interval)

    def stop(self) -> dict[str, float]:
        self._stop.set()
        self._thread.join()
        return dict(self.peaks)


def main(argv: list[str] | None = None) -> int:
    """`python tools/proc_tree.py [--json FILE] [--interval S] -- COMMAND ...`: runs COMMAND and prints its whole
    process tree's peak memory (the peak of the summed RSS, PSS, USS; by role) and each step's (the peak summed RSS
    while each direct child of COMMAND ran: a recipe's mindrl-sft, mindrl-train, mindrl-eval, ...). Exits with
    COMMAND's status."""
    import argparse
    import json
    import subprocess
    import sys

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--json", help="write the figures here as JSON")
    parser.add_argument("--interval", type=float, default=0.5, help="seconds between samples (default 0.5)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND [ARG ...]")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command given (python tools/proc_tree.py -- COMMAND ...)")
    t0, cpu0 = time.monotonic(), os.times()
    proc = subprocess.Popen(command)
    tree, phases = TreeMemory(proc.pid, interval=args.interval), PhaseMemory(proc.pid, interval=args.interval)
    try:
        rc = proc.wait()
    except KeyboardInterrupt:
        proc.terminate()
        rc = proc.wait()
    memory, by_phase = tree.stop(), phases.stop()
    cpu = os.times()
    memory.update(
        command=command,
        returncode=rc,
        wall_s=time.monotonic() - t0,
        children_cpu_s=(cpu.children_user - cpu0.children_user) + (cpu.children_system - cpu0.children_system),
        peak_rss_mb_by_step=by_phase,
    )
    print(
        f"[proc_tree] {' '.join(command)}: exit {rc}, {memory['wall_s']:.0f} s wall, {memory['children_cpu_s']:.0f} s "
        f"CPU (the tree's waited-for processes)",
        file=sys.stderr,
    )
    for line in format_roles(memory):
        print(f"[proc_tree] {line}", file=sys.stderr)
    for phase, mb in sorted(by_phase.items(), key=lambda kv: -kv[1]):
        print(f"[proc_tree]   step {phase:<40}peak RSS {mb:>8.0f} MiB", file=sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(memory, f, indent=1)
    return rc


if __name__ == "__main__":
    raise SystemExit(main())

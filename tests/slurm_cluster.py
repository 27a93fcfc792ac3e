"""A real two-node SLURM cluster on this one machine, started and stopped by the tests themselves.

Debian's ``slurmctld``, ``slurmd``, ``slurm-client`` and ``munge``: munged with its own key and socket in a temp
dir, a generated slurm.conf, and two ``slurmd -N n1|n2`` daemons on 127.0.0.1 with distinct ports. No cgroups
(``proctrack/linuxproc``, ``task/none``). Node names do not resolve through DNS: the cluster knows their
address (``NodeAddr=127.0.0.1``), which is what the sbatch templates must find.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

TOOLS = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "sinfo", "scancel")
PACKAGES = ["slurmctld", "slurmd", "slurm-client", "munge"]
INSTALL = f"apt-get install -y --no-install-recommends {' '.join(PACKAGES)}"
NODES = ("n1", "n2")


def install_debian_packages(packages: list[str]) -> str | None:
    """``apt-get install --no-install-recommends`` (about 10 s) when running as root on Debian; one process at a
    time (xdist workers share the machine). Returns why it could not, or None."""
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        return "not root on a Debian/Ubuntu machine: install them yourself"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *packages]
    with open("/tmp/fp8dist-tests-apt.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        proc = subprocess.run(install, env=env, capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:  # a fresh machine may have no package lists yet
            subprocess.run(["apt-get", "update", "-qq"], env=env, capture_output=True, timeout=600)
            proc = subprocess.run(install, env=env, capture_output=True, text=True, timeout=600)
    return None if proc.returncode == 0 else f"apt-get install failed: {proc.stderr.strip()[-500:]}"


def missing_reason() -> str | None:
    """Why no cluster can start here, or None. Installs Debian's packages first where it can."""
    if any(shutil.which(tool) is None for tool in TOOLS):
        install_debian_packages(PACKAGES)
    missing = [tool for tool in TOOLS if shutil.which(tool) is None]
    if missing:
        return f"SLURM/munge not installed ({', '.join(missing)} missing): {INSTALL}"
    if os.geteuid() != 0:
        return "the test cluster runs slurmd as root (SlurmUser=root): run the SLURM tests as root"
    return None


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class SlurmCluster:
    """Start with :meth:`start`, submit with :meth:`sbatch`, always :meth:`stop`."""

    def __init__(self, root: Path, cpus_per_node: int = 2):
        self.root = root
        self.cpus = cpus_per_node
        self.conf = root / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self.procs: list[subprocess.Popen] = []

    def _daemon(self, name: str, *cmd: str) -> None:
        log = open(self.root / "log" / f"{name}.out", "w")
        self.procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                           start_new_session=True))

    def _write_conf(self) -> None:
        r = self.root
        ctld_port, *node_ports = _free_ports(1 + len(NODES))
        host = socket.gethostname().split(".")[0]
        lines = [
            "ClusterName=fp8dist-test",
            f"SlurmctldHost={host}(127.0.0.1)",
            f"SlurmctldPort={ctld_port}",
            "SlurmUser=root", "SlurmdUser=root",
            "AuthType=auth/munge", "CredType=cred/munge", f"AuthInfo=socket={r / 'munge' / 'munge.socket'}",
            f"StateSaveLocation={r / 'state'}", f"SlurmdSpoolDir={r / 'spool'}/%n",
            f"SlurmctldPidFile={r / 'slurmctld.pid'}", f"SlurmdPidFile={r}/slurmd.%n.pid",
            f"SlurmctldLogFile={r / 'log' / 'slurmctld.log'}", f"SlurmdLogFile={r / 'log'}/slurmd.%n.log",
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none", "JobCompType=jobcomp/none", "MpiDefault=none",
            "SelectType=select/cons_tres", "SelectTypeParameters=CR_CPU", "SlurmdParameters=config_overrides",
            "ReturnToService=2", "SchedulerType=sched/builtin", "InactiveLimit=0", "KillWait=5", "MinJobAge=300",
        ]
        lines += [f"NodeName={name} NodeAddr=127.0.0.1 NodeHostname={host} Port={port} CPUs={self.cpus} "
                  "State=UNKNOWN" for name, port in zip(NODES, node_ports)]
        lines.append(f"PartitionName=debug Nodes={','.join(NODES)} Default=YES MaxTime=INFINITE State=UP "
                     "OverSubscribe=YES")
        self.conf.write_text("\n".join(lines) + "\n")

    def start(self, timeout: float = 60) -> None:
        for sub in ("munge", "state", "spool", "log"):
            (self.root / sub).mkdir(mode=0o755)
        key = self.root / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        m = self.root / "munge"
        # --force: munged's ownership checks of its directories expect the system layout, not a temp dir
        self._daemon("munged", "munged", "-F", "--force", f"--socket={m / 'munge.socket'}", f"--key-file={key}",
                     f"--pid-file={m / 'munged.pid'}", f"--seed-file={m / 'munged.seed'}",
                     f"--log-file={self.root / 'log' / 'munged.log'}")
        self._write_conf()
        self._daemon("slurmctld", "slurmctld", "-D", "-f", str(self.conf))
        for name in NODES:
            self._daemon(f"slurmd-{name}", "slurmd", "-D", "-N", name, "-f", str(self.conf))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %T"], env=self.env, capture_output=True, text=True)
            states = dict(line.split() for line in out.stdout.splitlines() if line.strip())
            if all(states.get(name) == "idle" for name in NODES):
                return
            dead = [p.args[0] for p in self.procs if p.poll() is not None]
            if dead:
                break
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"SLURM test cluster did not come up (daemons exited: {dead or 'none'}; "
                           f"sinfo: {out.stdout.strip() or out.stderr.strip()}):\n{self.logs()}")

    def logs(self) -> str:
        return "\n".join(f"== {p.name}\n{p.read_text()[-1500:]}" for p in sorted((self.root / "log").iterdir()))

    def sbatch(self, *args: str, env: dict[str, str] | None = None, cwd: Path | None = None,
               timeout: float = 600, submit: tuple[str, ...] = ("sbatch",)) -> tuple[int, str]:
        """Submit a batch job with ``submit`` (sbatch, or a command that runs it, e.g. ``fp8dist launch slurm
        torchrun``) and wait for it; returns its exit code and its output (or the submission's error).

        Polls every half second: ``sbatch --wait`` sleeps in growing steps and adds up to half a minute."""
        out = self.root / f"job-{time.monotonic_ns()}.out"
        proc = subprocess.run([*submit, "--parsable", f"--output={out}", *args], env={**self.env, **(env or {})},
                              cwd=cwd, capture_output=True, text=True, timeout=60)
        if proc.returncode != 0:
            return proc.returncode, f"sbatch failed: {proc.stderr}"
        job = proc.stdout.strip().split(";")[0]
        deadline = time.monotonic() + timeout
        while True:
            info = subprocess.run(["scontrol", "show", "job", job], env=self.env, capture_output=True, text=True)
            fields = dict(kv.split("=", 1) for kv in info.stdout.split() if "=" in kv)
            state = fields.get("JobState", "UNKNOWN")
            if state not in ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING"):
                break
            if time.monotonic() > deadline:
                subprocess.run(["scancel", job], env=self.env)
                raise TimeoutError(f"job {job} still {state} after {timeout}s")
            time.sleep(0.5)
        code = int(fields.get("ExitCode", "1:0").split(":")[0]) if state == "COMPLETED" else 1
        text = out.read_text() if out.exists() else ""
        return code, text if code == 0 else f"job {job} ended {state} ({fields.get('ExitCode')})\n{text}"

    def stop(self) -> None:
        subprocess.run(["scancel", "--full", "--partition=debug"], env=self.env, capture_output=True, timeout=30)
        for proc in reversed(self.procs):  # slurmd, slurmctld, then munged
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        self.procs.clear()

"""A real single-node SLURM cluster on this machine, for tests.

Installs Debian's `slurm-wlm` and `munge` when missing (root + apt-get only),
starts munged, slurmctld and slurmd with a config in a temporary folder and
private ports, and stops them again. Clients find it through ``SLURM_CONF``.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

PACKAGES = ["slurm-wlm", "munge"]
# The executor plugin's job step drops every SLURM_* variable (SLURM_CONF too)
# before its nested srun, so the config must sit where SLURM looks by default.
SYSTEM_CONF = Path("/etc/slurm/slurm.conf")


class SlurmUnavailable(RuntimeError):
    """SLURM is not installed and cannot be installed here (the reason says why)."""


def ensure_installed() -> None:
    if all(shutil.which(b) for b in ("sbatch", "slurmctld", "slurmd", "munged")):
        return
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        raise SlurmUnavailable(f"SLURM is not installed; install {' '.join(PACKAGES)} (needs root and apt-get)")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    cmd = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *PACKAGES]
    if subprocess.run(cmd, env=env, capture_output=True).returncode != 0:
        subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True, check=True)
        subprocess.run(cmd, env=env, capture_output=True, check=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_munge() -> None:
    if subprocess.run(["pgrep", "-x", "munged"], capture_output=True).returncode == 0:
        return
    key = Path("/etc/munge/munge.key")
    for d in ("/etc/munge", "/var/lib/munge", "/var/log/munge", "/run/munge"):
        Path(d).mkdir(parents=True, exist_ok=True)
    if not key.exists():
        key.write_bytes(os.urandom(1024))
    subprocess.run(["chown", "-R", "munge:munge", "/etc/munge", "/var/lib/munge", "/var/log/munge", "/run/munge"],
                   capture_output=True)
    key.chmod(0o400)
    subprocess.run(["munged", "--force"], check=True, capture_output=True)


def _mem_mb() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) // 1024 - 1024
    return 4000


class LocalSlurm:
    """slurmctld + slurmd for this host, one partition ``debug``."""

    def __init__(self, root: Path):
        self.root = root
        self.conf = root / "slurm.conf"
        self.host = socket.gethostname().split(".")[0]
        self.owns_system_conf = False

    def start(self) -> LocalSlurm:
        ensure_installed()
        if SYSTEM_CONF.exists():
            raise SlurmUnavailable(f"{SYSTEM_CONF} exists: this machine has a SLURM setup the test must not replace")
        _start_munge()
        for d in ("state", "spool"):
            (self.root / d).mkdir(parents=True, exist_ok=True)
        r = self.root
        self.conf.write_text(
            f"""ClusterName=diffpipetest
SlurmctldHost={self.host}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation={r}/state
SlurmdSpoolDir={r}/spool
SlurmctldPidFile={r}/slurmctld.pid
SlurmdPidFile={r}/slurmd.pid
SlurmctldLogFile={r}/slurmctld.log
SlurmdLogFile={r}/slurmd.log
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
MinJobAge=600
NodeName={self.host} CPUs={os.cpu_count()} RealMemory={_mem_mb()} State=UNKNOWN
PartitionName=debug Nodes={self.host} Default=YES MaxTime=INFINITE State=UP
"""
        )
        os.environ["SLURM_CONF"] = str(self.conf)
        SYSTEM_CONF.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(self.conf, SYSTEM_CONF)
        self.owns_system_conf = True
        subprocess.run(["slurmctld", "-f", str(self.conf)], check=True, capture_output=True)
        subprocess.run(["slurmd", "-f", str(self.conf)], check=True, capture_output=True)
        deadline = time.time() + 60
        while time.time() < deadline:
            out = subprocess.run(["sinfo", "-h", "-o", "%t"], capture_output=True, text=True).stdout.strip()
            if out in ("idle", "mix", "alloc"):
                return self
            time.sleep(0.5)
        self.stop()
        raise SlurmUnavailable(f"SLURM node did not come up: sinfo says {out!r}; see {r}/slurmctld.log")

    def stop(self) -> None:
        subprocess.run(["scancel", "--user", os.environ.get("USER", "root")], capture_output=True)
        for name in ("slurmd", "slurmctld"):
            pid_file = self.root / f"{name}.pid"
            if pid_file.exists():
                subprocess.run(["kill", pid_file.read_text().strip()], capture_output=True)
        os.environ.pop("SLURM_CONF", None)
        if self.owns_system_conf:
            SYSTEM_CONF.unlink(missing_ok=True)
            self.owns_system_conf = False

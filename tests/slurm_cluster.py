"""A real one-node SLURM for the tests: munged, slurmctld and slurmd of Debian's `slurm-wlm`,
started in the foreground from a slurm.conf in a folder of the test's, on ports of their own,
without systemd, cgroups or accounting. `start_cluster()` returns None with the reason where
SLURM cannot start here (not installed, not root), and the tests that need it skip with that
reason."""
from __future__ import annotations

import contextlib
import dataclasses
import os
import pwd
import shutil
import socket
import subprocess
import time
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd")
# More CPUs than these machines have (SlurmdParameters=config_overrides lets the node declare
# them): two tasks, each with its loader worker's CPU, as on a GPU node.
NODE_CPUS = 4
# A requeued job waits cred_expire + 1 seconds before it starts again, until the node has
# forgotten its old credential (120 s by default; one made to start sooner, by `scontrol update
# StartTime=now`, is killed with "Job credential revoked" and ends FAILED). 15 s still covers a
# step's launch on 2 busy cores. Nothing wakes the scheduler when that wait is over but its
# periodic pass, every sched_interval seconds (60 by default): 5 here.
CRED_EXPIRE = 15


@dataclasses.dataclass
class Cluster:
    folder: Path
    env: dict[str, str]  # SLURM_CONF: what sbatch, squeue, scancel and scontrol need
    daemons: list[subprocess.Popen]

    def run(self, *cmd: str, check: bool = True) -> subprocess.CompletedProcess:
        result = subprocess.run(cmd, env={**os.environ, **self.env}, capture_output=True, text=True, timeout=30)
        if check and result.returncode != 0:
            raise AssertionError(f"{' '.join(cmd)}: exit {result.returncode}\n{result.stdout}{result.stderr}\n"
                                 f"{self.logs()}")
        return result

    def job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job`'s fields (JobState, Restarts, ExitCode, ...)."""
        out = self.run("scontrol", "show", "job", "--oneliner", job_id).stdout
        return dict(field.split("=", 1) for field in out.split() if "=" in field)

    def logs(self) -> str:
        return "\n".join(f"--- {log.name}:\n{log.read_text()[-3000:]}" for log in sorted(self.folder.glob("*.log")))

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            self.run("scancel", "--full", "--signal=KILL", "--user=root", check=False)
        for proc in reversed(self.daemons):
            proc.terminate()
        for proc in reversed(self.daemons):
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def cannot_start() -> str | None:
    missing = [name for name in (*DAEMONS, "sbatch") if shutil.which(name) is None]
    if missing:
        return f"SLURM is not installed here ({', '.join(missing)} not found; Debian: apt-get install slurm-wlm munge)"
    if os.geteuid() != 0:
        return "starting slurmd takes root"
    if not Path("/etc/munge/munge.key").is_file():
        return "munge has no key (/etc/munge/munge.key)"
    return None


def start_cluster(folder: Path, timeout: float = 60) -> tuple[Cluster | None, str]:
    reason = cannot_start()
    if reason:
        return None, reason
    folder.mkdir(parents=True, exist_ok=True)
    munge_dir = folder / "munge"
    munge_dir.mkdir()
    munge_dir.chmod(0o755)  # munged: "execute permissions for all required" on its socket's folder
    munge_user = pwd.getpwnam("munge")
    os.chown(munge_dir, munge_user.pw_uid, munge_user.pw_gid)
    munge_socket = munge_dir / "munge.socket"
    host = socket.gethostname()
    ctld_port, slurmd_port = free_ports(2)
    conf = folder / "slurm.conf"
    conf.write_text(f"""\
ClusterName=tests
SlurmctldHost={host}
SlurmUser=root
SlurmdUser=root
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
AuthType=auth/munge
AuthInfo=socket={munge_socket},cred_expire={CRED_EXPIRE}
CredType=cred/munge
StateSaveLocation={folder}/state
SlurmdSpoolDir={folder}/spool
SlurmctldPidFile={folder}/slurmctld.pid
SlurmdPidFile={folder}/slurmd.pid
SlurmctldLogFile={folder}/slurmctld.log
SlurmdLogFile={folder}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
LaunchParameters=use_interactive_step
SchedulerType=sched/builtin
SchedulerParameters=sched_interval=5
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SlurmdParameters=config_overrides
ReturnToService=2
JobRequeue=1
KillWait=30
MinJobAge=600
NodeName={host} NodeAddr=127.0.0.1 CPUs={NODE_CPUS} State=UNKNOWN
PartitionName=tests Nodes={host} Default=YES MaxTime=INFINITE State=UP
""")
    for sub in ("state", "spool"):
        (folder / sub).mkdir()
    env = {"SLURM_CONF": str(conf)}
    daemons: list[subprocess.Popen] = []
    cluster = Cluster(folder, env, daemons)

    def daemon(cmd: list[str], log: str, **kw) -> None:
        with open(folder / log, "w") as out:
            daemons.append(subprocess.Popen(cmd, env={**os.environ, **env}, stdout=out, stderr=subprocess.STDOUT,
                                            start_new_session=True, **kw))

    daemon(["munged", "-F", f"--socket={munge_socket}", f"--pid-file={munge_dir}/munged.pid",
            f"--seed-file={munge_dir}/munged.seed", f"--log-file={munge_dir}/munged.log"], "munged.log",
           user=munge_user.pw_uid, group=munge_user.pw_gid)
    deadline = time.monotonic() + timeout
    while not munge_socket.exists():
        if time.monotonic() > deadline or daemons[0].poll() is not None:
            cluster.stop()
            return None, f"munged did not start: {(folder / 'munged.log').read_text()[-500:]}"
        time.sleep(0.1)
    daemon(["slurmctld", "-D", "-i"], "slurmctld.out")
    daemon(["slurmd", "-D"], "slurmd.out")
    while True:
        state = cluster.run("sinfo", "--noheader", "--format=%T", check=False).stdout.strip()
        if state.startswith("idle"):
            return cluster, ""
        if time.monotonic() > deadline or any(p.poll() is not None for p in daemons):
            cluster.stop()
            logs = cluster.logs() + "".join((folder / n).read_text()[-500:] for n in ("slurmctld.out", "slurmd.out"))
            return None, f"SLURM did not come up (sinfo: {state!r}):\n{logs}"
        time.sleep(0.2)

#!/usr/bin/env bash
# A one-machine SLURM cluster for the tests (tests/test_slurm_cluster.py): munged, slurmctld and
# slurmd of Debian's slurm-wlm (22.05), private to one folder, so that it touches no /etc/slurm and
# two of them (two test runs side by side) share nothing but the packages.
#
#   tools/slurm_cluster.sh start DIR   install the packages if missing (root, apt-get), write
#                                      DIR/slurm.conf, start the daemons, wait until the node is
#                                      idle; prints SLURM_CONF=DIR/slurm.conf (export it to use it)
#   tools/slurm_cluster.sh stop DIR    cancel its jobs and stop its daemons (by their pid files)
#
# start stops whatever DIR already runs first, so both can be run again at any time. Exit 3 with
# one line "cannot run here: ..." where this machine does not allow it (not root, no apt-get, the
# install failed): the tests skip with that line; any other failure is an error.
set -euo pipefail
export PATH="$PATH:/usr/sbin:/sbin"

cannot() { echo "slurm_cluster: cannot run here: $*" >&2; exit 3; }
fail() { echo "slurm_cluster: $*" >&2; exit 1; }
[ $# -eq 2 ] && { [ "$1" = start ] || [ "$1" = stop ]; } || fail "usage: $0 start|stop DIR"
DIR=$(realpath -m "$2")
export SLURM_CONF="$DIR/slurm.conf"
START_TIMEOUT_S=${START_TIMEOUT_S:-120}

alive() { [ -n "$1" ] && kill -0 "$1" 2>/dev/null; }
pid_of() { [ -s "$DIR/$1.pid" ] && cat "$DIR/$1.pid" || true; }

stop_daemon() {  # stop_daemon NAME: SIGTERM to the pid in DIR/NAME.pid (if it is NAME), then wait
  local pid; pid=$(pid_of "$1")
  if alive "$pid" && [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "$1" ]; then
    kill "$pid"
    for _ in $(seq 300); do alive "$pid" || break; sleep 0.1; done
    ! alive "$pid" || { kill -9 "$pid" 2>/dev/null || true; }
  fi
  rm -f "$DIR/$1.pid"
}

stop() {
  if alive "$(pid_of slurmctld)"; then  # its jobs' steps outlive slurmd: cancel them first
    scancel --full --quiet --user=root 2>/dev/null || true
    for _ in $(seq 300); do [ -z "$(squeue -h -t running,completing -o %i 2>/dev/null)" ] && break; sleep 0.1; done
  fi
  stop_daemon slurmd
  stop_daemon slurmctld
  stop_daemon munged
}

install() {
  command -v apt-get >/dev/null || cannot "SLURM is not installed and there is no apt-get"
  local started=$SECONDS log="$DIR/apt.log" policy=/usr/sbin/policy-rc.d added=""
  if [ ! -e $policy ]; then  # the packages' own services stay stopped: only this folder's run
    printf '#!/bin/sh\nexit 101\n' > $policy && chmod +x $policy && added=1
  fi
  local pkgs=(slurmctld slurmd slurm-client munge)
  local apt=(apt-get -q -o DPkg::Lock::Timeout=300)  # a second test run installing beside: wait for it
  DEBIAN_FRONTEND=noninteractive "${apt[@]}" install -y --no-install-recommends "${pkgs[@]}" > "$log" 2>&1 ||
    { "${apt[@]}" update >> "$log" 2>&1 &&
      DEBIAN_FRONTEND=noninteractive "${apt[@]}" install -y --no-install-recommends "${pkgs[@]}" >> "$log" 2>&1; } ||
    { [ -z "$added" ] || rm -f $policy; cannot "apt-get install ${pkgs[*]} failed: $(grep -E '^E:' "$log" | head -1)"; }
  [ -z "$added" ] || rm -f $policy
  echo "slurm_cluster: installed ${pkgs[*]} in $((SECONDS - started)) s" >&2
}

free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])'; }

write_config() {
  local host; host=$(hostname -s)
  local ctld_port; ctld_port=$(free_port)
  local slurmd_port; slurmd_port=$(free_port)
  while [ "$slurmd_port" = "$ctld_port" ]; do slurmd_port=$(free_port); done
  local mem_mb=$(($(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 / 2))  # half the machine's, at most 4 GB
  [ $mem_mb -le 4000 ] || mem_mb=4000
  cat > "$SLURM_CONF" <<EOF
# written by tools/slurm_cluster.sh: one node, this machine, everything under $DIR
ClusterName=acco-test
SlurmctldHost=$host
SlurmctldPort=$ctld_port
SlurmdPort=$slurmd_port
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# cred_expire: a requeued job waits that long before it may start again (120 s by default)
AuthInfo=socket=$DIR/munge/munge.socket,cred_expire=10
StateSaveLocation=$DIR/ctld
SlurmdSpoolDir=$DIR/slurmd
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.pid
SlurmctldLogFile=$DIR/slurmctld.log
SlurmdLogFile=$DIR/slurmd.log
# no cgroups: the processes are tracked through /proc
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SwitchType=switch/none
SchedulerType=sched/backfill
# a requeued job starts on the next scheduling pass once its hold is over: every second, not every 30-60
SchedulerParameters=bf_interval=1,sched_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
JobAcctGatherType=jobacct_gather/none
ReturnToService=2
# acco derives its rendezvous port from the job id (29500 + id % 3000): two clusters side by side
# start from different ids
FirstJobId=$((RANDOM % 2900 + 1))
# the node as written here, whatever slurmd finds (at least 2 CPUs: the tests' 2 tasks)
SlurmdParameters=config_overrides
NodeName=$host CPUs=$(( $(nproc) < 2 ? 2 : $(nproc) )) RealMemory=$mem_mb State=UNKNOWN
PartitionName=test Nodes=$host Default=YES MaxTime=INFINITE State=UP
EOF
}

start() {
  [ "$(uname -s)" = Linux ] || cannot "not Linux"
  [ "$(id -u)" = 0 ] || cannot "not root (the daemons run as root; the packages come from apt-get)"
  mkdir -p "$DIR"
  stop
  for tool in munged slurmctld slurmd sinfo sbatch srun scontrol scancel squeue; do
    command -v $tool >/dev/null || { install; break; }
  done
  rm -rf "$DIR/munge" "$DIR/ctld" "$DIR/slurmd"
  mkdir -p "$DIR/munge" "$DIR/ctld" "$DIR/slurmd"
  chmod 700 "$DIR/munge"
  head -c 1024 /dev/urandom > "$DIR/munge/munge.key"
  chmod 400 "$DIR/munge/munge.key"
  write_config
  local started=$SECONDS
  # --force: munged wants every folder above its socket open to all; this one is private to root
  munged --force --socket="$DIR/munge/munge.socket" --key-file="$DIR/munge/munge.key" \
    --pid-file="$DIR/munged.pid" --log-file="$DIR/munged.log" --seed-file="$DIR/munge/munge.seed" ||
    fail "munged did not start ($DIR/munged.log)"
  slurmctld -f "$SLURM_CONF" || fail "slurmctld did not start ($DIR/slurmctld.log)"
  slurmd -f "$SLURM_CONF" || fail "slurmd did not start ($DIR/slurmd.log)"
  local state=""
  while [ $((SECONDS - started)) -lt "$START_TIMEOUT_S" ]; do
    state=$(sinfo -h -N -o %t 2>/dev/null || true)
    [ "$state" = idle ] && break
    sleep 0.2
  done
  [ "$state" = idle ] ||
    fail "the node is not idle after ${START_TIMEOUT_S} s (sinfo: '${state}'; logs in $DIR)"
  echo "slurm_cluster: started in $((SECONDS - started)) s" >&2
  echo "SLURM_CONF=$SLURM_CONF"
}

"$1"

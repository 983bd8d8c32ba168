# Sourced by tuning/slurm_sweep.sbatch and tuning/slurm_run.sbatch (from the repository, the job's working
# directory): a Ray cluster on the job's nodes, checked against the allocation, a driver run beside it, and the
# job's end.
#
#   ray_up                     Ray head on the first node, a Ray worker on each other node; sets nodes, head_node,
#                              address (head IP:PORT), cpus and gpus (per node), workers_per_node, gpus_per_worker
#   run_driver RESUME_CMD CMD...
#                              runs CMD on this (the head) node; a signal to the job (a time limit, scancel) ends it
#                              and the job exits 130 printing RESUME_CMD (so does CMD's own 130 or 143); otherwise
#                              the job exits with CMD's code
#
# Needs PORT, CPUS_PER_WORKER and say() from the script.  Every node's Ray runs inside its own srun step; at the
# end (or on any failure) each of those srun processes gets SIGTERM by process id, workers first, and cancels its
# step: Slurm ends every process of it (`ray start`, the raylet, the GCS, the workers).  Never `ray stop`: it ends
# every Ray on the node.

ray_pids=()
stop_ray() {
  local i pid t
  for ((i = ${#ray_pids[@]} - 1; i >= 0; i--)); do
    pid="${ray_pids[i]}"
    kill -TERM "${pid}" 2>/dev/null || continue
    for ((t = 0; t < 60; t++)); do kill -0 "${pid}" 2>/dev/null || break; sleep 1; done
    kill -KILL "${pid}" 2>/dev/null || true
    wait "${pid}" 2>/dev/null || true
  done
  [[ ${#ray_pids[@]} -eq 0 ]] || say "ray stopped on ${#ray_pids[@]} node(s)"
}
trap stop_ray EXIT
# a signal before the driver runs: nothing was started that a resume would continue
trap 'say "stopped by a signal before the driver started; submit the job again"; exit 130' TERM INT

ray_up() {
  nodes=($(scontrol show hostnames "${SLURM_JOB_NODELIST}"))
  head_node="${nodes[0]}"
  cpus="${SLURM_CPUS_PER_TASK:?needs --cpus-per-task}"
  # the GPUs a step on a node sees, not the batch step's SLURM_GPUS_ON_NODE: with --exclusive the job holds every
  # GPU of its nodes (the batch step sees them all) while each step gets the --gpus-per-node it asked for, and
  # the steps are where Ray runs.  srun has not read SLURM_CPUS_PER_TASK since Slurm 22.05: each step says it.
  local probe
  probe=$(srun --nodes=1 --ntasks=1 --cpus-per-task="${cpus}" -w "${head_node}" \
    bash -c 'echo "$(hostname --ip-address | awk "{print \$1}") ${SLURM_GPUS_ON_NODE:-0}"')
  read -r head_ip gpus <<< "${probe}"
  address="${head_ip}:${PORT}"
  local plan idle_gpus
  plan=$(python tuning/slurm_ray.py plan --cpus "${cpus}" --gpus "${gpus}" --cpus-per-worker "${CPUS_PER_WORKER}")
  read -r gpus_per_worker workers_per_node idle_gpus <<< "${plan}"
  say "allocation: ${#nodes[@]} node(s) x ${cpus} CPU, ${gpus} GPU (${SLURM_JOB_NODELIST})"
  if [[ "${SLURM_GPUS_ON_NODE:-0}" != "${gpus}" ]]; then
    say "the job holds ${SLURM_GPUS_ON_NODE:-0} GPU(s) per node (--exclusive) and asked for ${gpus}: Ray uses ${gpus}"
  fi
  say "workers: ${workers_per_node} per node, engine.num_cpus_per_worker=${CPUS_PER_WORKER}" \
      "engine.num_gpus_per_worker=${gpus_per_worker}"
  if [[ "${idle_gpus}" != 0 ]]; then
    say "warning: ${workers_per_node} workers of ${gpus_per_worker} GPU leave ${idle_gpus} of a node's ${gpus} GPUs" \
        "idle; choose CPUS_PER_WORKER so that the workers per node and the GPUs divide one another"
  fi

  # Ray's token authentication: every node and the driver need the same token
  export RAY_AUTH_MODE="${RAY_AUTH_MODE:-token}"
  if [[ "${RAY_AUTH_MODE}" == token && -z "${RAY_AUTH_TOKEN:-}" ]]; then
    if [[ -n "${RAY_AUTH_TOKEN_PATH:-}" ]]; then
      if [[ ! -s "${RAY_AUTH_TOKEN_PATH}" ]]; then
        say "error: RAY_AUTH_TOKEN_PATH=${RAY_AUTH_TOKEN_PATH} is empty or missing" >&2
        exit 2
      fi
    elif [[ ! -s "${HOME}/.ray/auth_token" ]]; then
      ray get-auth-token --generate >/dev/null
    fi
  fi
  # nothing is left to drain when the job ends: a node stops at once
  export RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S="${RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S:-0}"

  # the step's own CPUs and GPUs are what this node's Ray declares
  local ray_node='exec ray start --num-cpus="${SLURM_CPUS_PER_TASK}" --num-gpus="${SLURM_GPUS_ON_NODE:-0}" --block "$@"'
  say "Ray head on ${head_node} (${address})"
  srun --nodes=1 --ntasks=1 --cpus-per-task="${cpus}" -w "${head_node}" bash -c "${ray_node}" ray-head \
    --head --node-ip-address="${head_ip}" --port="${PORT}" ${RAY_HEAD_ARGS:---dashboard-host=127.0.0.1} \
    ${RAY_START_ARGS:-} &
  ray_pids+=($!)
  # the head alone first: its GPUs are Slurm's, or the job stops here
  python tuning/slurm_ray.py wait --address "${address}" --nodes 1 --cpus "${cpus}" --gpus "${gpus}" \
    --watch "${ray_pids[@]}"
  if [[ ${#nodes[@]} -gt 1 ]]; then
    local node
    for node in "${nodes[@]:1}"; do
      say "Ray worker on ${node}"
      srun --nodes=1 --ntasks=1 --cpus-per-task="${cpus}" -w "${node}" bash -c "${ray_node}" ray-worker \
        --address="${address}" ${RAY_START_ARGS:-} &
      ray_pids+=($!)
    done
    # the GPUs Ray offers are the GPUs Slurm allocated, or the job stops here
    python tuning/slurm_ray.py wait --address "${address}" --nodes "${#nodes[@]}" --cpus "${cpus}" --gpus "${gpus}" \
      --watch "${ray_pids[@]}"
  fi
}

run_driver() {
  local resume="$1" driver rc signalled=0
  shift
  trap 'signalled=1' TERM INT
  # SIGINT as Ctrl-C gives it (a background command of a script would ignore it): a signal that reaches the job's
  # shell alone (scancel --batch) stops the driver gracefully, saving where it is
  (trap - INT; exec "$@") &
  driver=$!
  wait "${driver}" && rc=0 || rc=$?
  # 130: stopped before the end (Slurm's time limit sends SIGTERM to every process of the job: the driver stops at
  # once, its checkpoints are what a resume continues from); tune.py and rayfed-dg run exit 130 on Ctrl-C and
  # SIGTERM too, and 143 is a driver a SIGTERM ended before it could handle one
  if [[ ${signalled} == 1 ]]; then
    # said first: SIGKILL follows a time limit's SIGTERM after KillWait
    say "stopped before the end by a signal (a time limit, scancel); continue with: ${resume}"
    kill -INT "${driver}" 2>/dev/null || true
    # a further signal ends this wait, not the driver's saving: wait again while it runs
    while kill -0 "${driver}" 2>/dev/null; do wait "${driver}" 2>/dev/null || true; done
    exit 130
  elif [[ ${rc} == 130 || ${rc} == 143 ]]; then
    say "stopped before the end; continue with: ${resume}"
    exit 130
  fi
  trap - TERM INT  # the driver is done: what follows is not a sweep or run to continue
  return "${rc}"
}

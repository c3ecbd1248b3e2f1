#!/usr/bin/env bash
# Submit a training run to a running Ray cluster, with the same config and overrides as a local run:
#
#   RAY_ADDRESS=http://<head>:8265 launch/submit_job.sh --config-name frozenlake \
#       model_path=/models/Qwen2.5-0.5B-Instruct trainer.default_local_dir=/shared/runs/frozenlake
#
# The repository is uploaded as the job's working directory (launch/runtime_env.yaml), so model_path
# and trainer.default_local_dir must be paths the cluster's nodes can read and write. The command
# streams the job's logs and exits 0 when the job succeeded, 1 when it failed (docs/cluster.md).
#
# Environment:
#   RAY_ADDRESS   the cluster's dashboard address (required), e.g. http://head:8265
#   PYTHON        the Python the job runs with on the cluster (default: python, the first on its PATH)
#   RAY_JOB_ARGS  more `ray job submit` options, e.g. "--no-wait --submission-id frozenlake_1"
set -euo pipefail
cd "$(dirname "$0")/.."
: "${RAY_ADDRESS:?set RAY_ADDRESS to the dashboard address of the Ray cluster, e.g. http://head:8265}"
read -r -a job_args <<< "${RAY_JOB_ARGS:-}"
exec ray job submit --address "$RAY_ADDRESS" --runtime-env launch/runtime_env.yaml "${job_args[@]}" -- \
    "${PYTHON:-python}" -m agent_trainer.main "$@"

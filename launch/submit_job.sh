#!/usr/bin/env bash
# Submit a training run to a running Ray cluster; the same config and overrides as a local run.
#   RAY_ADDRESS=http://<head>:8265 launch/submit_job.sh --config-name frozenlake model_path=/models/Qwen2.5-0.5B-Instruct
set -euo pipefail
cd "$(dirname "$0")/.."
: "${RAY_ADDRESS:?set RAY_ADDRESS to the cluster's dashboard address, e.g. http://head:8265}"
exec ray job submit --address "$RAY_ADDRESS" --runtime-env launch/runtime_env.yaml -- \
    python -m agent_trainer.main "$@"

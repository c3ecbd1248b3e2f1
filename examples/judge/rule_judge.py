"""A stand-in judge to try `judge.*` without a model: an OpenAI-compatible chat-completions endpoint whose
"model" is a rule. It reads the trajectories of the request (pointwise: one ``<trajectory>`` block; ranking:
``<trajectory id="i">`` blocks) and scores each: 1.0 when the agent's last reply holds <answer>a number</answer>,
0.5 when it holds a number without the tags, 0.0 otherwise. Replace it with any real endpoint (a `vllm serve`
of an instruct model, OpenAI, ...) by changing judge.base_url and judge.model.

    export JUDGE_API_KEY=$(python -c "import secrets; print(secrets.token_urlsafe(24))")
    python examples/judge/rule_judge.py --port 8011 &
    python -m agent_trainer.main --config-name arith_grpo_judge

It listens on 127.0.0.1 and answers only requests carrying ``Authorization: Bearer $JUDGE_API_KEY``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from openai.types.chat import ChatCompletion

BLOCK = re.compile(r'<trajectory(?: id="(\d+)")?>\n(.*?)\n</trajectory>', re.DOTALL)
ANSWER = re.compile(r"<answer>\s*-?\d+(?:\.\d+)?\s*</answer>")
NUMBER = re.compile(r"-?\d+")


def rule_score(trajectory: str) -> float:
    """The rule, applied to the text after the trajectory's last assistant turn marker (the last reply)."""
    reply = trajectory.rsplit("assistant", 1)[-1]
    return 1.0 if ANSWER.search(reply) else 0.5 if NUMBER.search(reply) else 0.0


def make_app(key: str) -> FastAPI:
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def complete(request: Request):
        if request.headers.get("authorization") != f"Bearer {key}":
            return JSONResponse({"error": {"message": "missing or wrong API key"}}, status_code=401)
        body = await request.json()
        blocks = BLOCK.findall(body["messages"][-1]["content"])
        if len(blocks) == 1 and not blocks[0][0]:
            content = json.dumps({"explanation": "rule", "score": rule_score(blocks[0][1])})
        else:
            content = json.dumps({"scores": [{"trajectory_id": tid, "explanation": "rule", "score": rule_score(text)}
                                             for tid, text in blocks]})
        completion = ChatCompletion(id=f"rule-{time.monotonic_ns()}", object="chat.completion",
                                    created=int(time.time()), model=body.get("model", "rule"),
                                    choices=[{"index": 0, "finish_reason": "stop",
                                              "message": {"role": "assistant", "content": content}}])
        return completion.model_dump(mode="json")

    return app


def main() -> None:
    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8011)
    parser.add_argument("--key-env", default="JUDGE_API_KEY", help="environment variable holding the API key")
    args = parser.parse_args()
    key = os.environ.get(args.key_env, "")
    if not key:
        raise SystemExit(f"rule_judge: set {args.key_env} to the key the trainer sends (judge.api_key_env)")
    uvicorn.run(make_app(key), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()

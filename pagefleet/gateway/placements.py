"""What this gateway sent where, for the moments the index cannot know it yet.

The index learns a block only after a daemon computed it and its event reached Redis: a
request's prefill (queueing included) plus the publisher's flush. Requests sharing a new
prefix that arrive in that window — a tenant's first burst, an agent's next turn — would
otherwise each look like a miss everywhere, be spread by load, and be prefilled (and
cached, evicting others) on several pods. No router that waits for the engine to publish
can place them together; sglang-router and vllm-router never wait: they remember what they
routed. This module does the same, only for the short time until the exact index takes
over.

Invariant: a (block key, pod) pair counts as "sent" while a request carrying that key is
in flight to that pod, and for ``ttl_s`` after the last such request finished; then it is
forgotten and the index alone decides. The router takes, per pod, the larger of the
index's match and this one, so the index overrules whenever it knows more, and a record
whose blocks the pod did not keep (eviction) lapses ``ttl_s`` after the request ended.

Several gateway replicas share their placements through Redis pub/sub
(shared_placements.py): the other replicas' records arrive through ``remember`` and hold
for a fixed horizon (their end is not published); the lookup treats them as this
replica's own.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field


@dataclass(slots=True)
class PlacementMemory:
    """Recent placements for matching (``ttl_s``) and each pod's recent footprint.

    The footprint of a pod is the number of distinct block keys this gateway sent it in the
    last ``footprint_window_s``: the working set it asked that pod to keep. New prefixes go
    where the footprint leaves the most room, as a cache that must hold what it was sent.
    """

    ttl_s: float = 2.0
    footprint_window_s: float = 60.0
    clock: Callable[[], float] = time.monotonic
    # pod -> key -> last time sent; deque of (time, pod, keys): one entry per request,
    # not per block (the request path pays one append, pruning the per-key work)
    _seen: dict[str, dict[int, float]] = field(default_factory=dict)
    _seen_q: deque[tuple[float, str, Sequence[int]]] = field(default_factory=deque)
    # the last block key of each prompt sent in that window -> when: a prompt that
    # extends one of them is that conversation's next turn (``extends``)
    _ends: dict[int, float] = field(default_factory=dict)
    # key -> pod -> requests in flight carrying that key to that pod
    _live: dict[int, dict[str, int]] = field(default_factory=dict)
    # key -> pod -> time after which a finished placement is forgotten
    _until: dict[int, dict[str, float]] = field(default_factory=dict)
    _expiry: deque[tuple[float, Sequence[int], str]] = field(default_factory=deque)
    # Other replicas' placements (shared_placements.py): key -> pod -> until; its own
    # queue, since their horizon differs from ``ttl_s`` (a queue is pruned from the front)
    _remote: dict[int, dict[str, float]] = field(default_factory=dict)
    _remote_q: deque[tuple[float, int, str]] = field(default_factory=deque)
    # The prompts (their block keys) of the requests in flight, any pod: a handful
    # (the gateway's concurrency), read only to tell copies of a prefix from requests
    # that extend it with their own history (``copies_inflight``)
    _open: list[Sequence[int]] = field(default_factory=list)

    def begin(self, keys: Sequence[int], pod: str) -> None:
        """A request carrying ``keys`` was sent to ``pod``."""
        now = self.clock()
        live = self._live
        for k in keys:
            pods = live.get(k)
            if pods is None:
                live[k] = {pod: 1}
            else:
                pods[pod] = pods.get(pod, 0) + 1
        self._seen.setdefault(pod, {}).update(dict.fromkeys(keys, now))
        self._seen_q.append((now, pod, keys))
        if keys:
            self._ends[keys[-1]] = now
            self._open.append(keys)

    def end(self, keys: Sequence[int], pod: str) -> None:
        """That request finished (or failed): remember it for ``ttl_s`` more."""
        until = self.clock() + self.ttl_s
        if keys:
            self._close(keys)
        ended: list[int] = []
        for k in keys:
            pods = self._live.get(k)
            if pods is None or pod not in pods:
                continue
            if pods[pod] <= 1:
                del pods[pod]
                if not pods:
                    del self._live[k]
            else:
                pods[pod] -= 1
            self._until.setdefault(k, {})[pod] = until
            ended.append(k)
        if ended:
            self._expiry.append((until, ended, pod))
        self._prune()

    def remember(self, keys: Sequence[int], pod: str, until: float) -> None:
        """Another replica sent ``keys`` to ``pod``: count it as sent until ``until``
        (the latest such time wins, so a pod's keys along a prompt stay a prefix)."""
        for k in keys:
            pods = self._remote.setdefault(k, {})
            if until > pods.get(pod, 0.0):
                pods[pod] = until
                self._remote_q.append((until, k, pod))

    def extends(self, key: int) -> bool:
        """Block ``key`` ended a prompt sent recently: a prompt whose leading blocks end
        there continues that prompt (a conversation's next turn)."""
        return key in self._ends

    def inflight_with(self, key: int) -> int:
        """Requests in flight (any pod) whose prompt carries block ``key``."""
        return sum(self._live.get(key, {}).values())

    def copies_inflight(self, key: int, depth: int, spare: int) -> int:
        """Requests in flight whose prompt carries ``key`` as its ``depth``-th block and
        ends at most ``spare`` blocks after it: copies of that prefix (the same prompt,
        or a first turn on a shared system prompt), not requests extending it with a
        history of their own (a conversation's later turns, tied to the pod holding it)."""
        n = 0
        for keys in self._open:
            if depth <= len(keys) <= depth + spare and keys[depth - 1] == key:
                n += 1
        return n

    def _close(self, keys: Sequence[int]) -> None:
        open_ = self._open
        for i in range(len(open_) - 1, -1, -1):
            if open_[i] is keys:
                del open_[i]
                return
        for i in range(len(open_) - 1, -1, -1):
            if open_[i] == keys:
                del open_[i]
                return

    def footprint(self, pod: str) -> int:
        """Distinct keys sent to ``pod`` within ``footprint_window_s``."""
        self._prune()
        return len(self._seen.get(pod, ()))

    def forget_pod(self, pod: str) -> None:
        """Drop every finished record of ``pod`` (it failed, or cleared its cache)."""
        self._seen.pop(pod, None)
        for table in (self._until, self._remote):
            for k in list(table):
                pods = table[k]
                pods.pop(pod, None)
                if not pods:
                    del table[k]

    def lookup(self, keys: Sequence[int]) -> dict[str, int]:
        """Pod -> number of leading ``keys`` sent to it (in flight or within ``ttl_s``).

        Keys are chain hashes: every request that carried key ``i`` carried keys ``0..i``
        to the same pod, and recorded them with the same times, so a pod's keys along one
        prompt form a prefix; a binary search per pod finds its end (a handful of dict
        probes instead of a set operation per block)."""
        if not keys:
            return {}
        self._prune()
        matched: dict[str, int] = {}
        for pod in self._holders(keys[0]):
            lo, hi = 1, len(keys)  # keys[:lo] held; keys[hi:] not
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if self._holds(keys[mid - 1], pod):
                    lo = mid
                else:
                    hi = mid - 1
            matched[pod] = lo
        return matched

    def _holds(self, key: int, pod: str) -> bool:
        live = self._live.get(key)
        if live is not None and pod in live:
            return True
        until = self._until.get(key)
        if until is not None and pod in until:
            return True
        remote = self._remote.get(key)
        return remote is not None and pod in remote

    def __len__(self) -> int:
        return len(self._live) + len(self._until) + len(self._remote)

    def _holders(self, key: int) -> set[str]:
        pods = set(self._live.get(key, ()))
        pods.update(self._until.get(key, ()))
        pods.update(self._remote.get(key, ()))
        return pods

    def _prune(self) -> None:
        now = self.clock()
        horizon = now - self.footprint_window_s
        sq = self._seen_q
        while sq and sq[0][0] <= horizon:
            t, pod, sent = sq.popleft()
            if sent and self._ends.get(sent[-1]) == t:
                del self._ends[sent[-1]]
            seen = self._seen.get(pod)
            if seen is None:
                continue
            for k in sent:
                # Sent again since: the newer entry ages it out.
                if seen.get(k) == t:
                    del seen[k]
            if not seen:
                del self._seen[pod]  # pods come and go (rollouts): no empty table per name
        q = self._expiry
        while q and q[0][0] <= now:
            until, ended, pod = q.popleft()
            for k in ended:
                pods = self._until.get(k)
                # Renewed since (a later request ended later): that record's own entry
                # expires it.
                if pods is not None and pods.get(pod) == until:
                    del pods[pod]
                    if not pods:
                        del self._until[k]
        rq = self._remote_q
        while rq and rq[0][0] <= now:
            until, k, pod = rq.popleft()
            pods = self._remote.get(k)
            if pods is not None and pods.get(pod) == until:
                del pods[pod]
                if not pods:
                    del self._remote[k]

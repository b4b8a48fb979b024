"""The daemon's side of prefill/decode disaggregation: what ``kv_transfer_params`` does.

- ``do_remote_decode`` (sent to a prefill pod, with ``max_tokens=1``): the prompt runs
  here (under the caller's ``remote_request_id`` when it names one, else a request id of
  its own); when it finishes its KV stays pinned under that id and the response carries
  ``kv_transfer_params`` saying where to pull it (``do_remote_prefill``, ``remote_host``,
  ``remote_port``, ``remote_request_id``, ``remote_engine_id``, ``remote_block_ids``).
- ``do_remote_prefill`` (sent to a decode pod, with the original request): reserve blocks,
  pull only what the local prefix cache lacks, verify, commit, decode. With
  ``remote_pending`` the prefill may still be running (the gateway sent the prompt to both
  pods at once and named the handle itself): the blocks are reserved first, in parallel
  with the prefill, then the pod waits for the handle (``/v1/kv/wait``) and pulls at once.
  Any failure of the pull (dead host, expired or forged handle, another model) is counted
  by reason and the request is prefilled here instead: the caller gets its answer either
  way. A handle this pod will not pull (its own cache holds every block, or it prefills
  locally while the handle may still be live) is released on the prefill pod at once, in
  the background, so its blocks do not stay pinned until the deadline.
- No params: the request is served as by a unified pod.

Trust: with the fleet's P/D secret (``PAGEFLEET_KV_TRANSFER_SECRET``, httpauth.py) a prefill
pod signs the params it returns and a decode pod pulls only with params whose signature
verifies, so the host it pulls from, and shows its upstream key to, is one a pod (or the
gateway) of its own fleet named. Checked before it connects anywhere: unsigned params are
prefilled locally (``unsigned``: a gateway that has no secret yet, mid-rollout, costs no
client an error), altered or foreign-signed ones refused (400, naming the field), expired
ones prefilled locally (``expired``: their handle is gone by then). Without a secret
nothing is signed or checked, as before, and the daemon says so once at start.

Invariant: a reservation opened for a pull ends in a commit or a cancel on every path
(failure, client gone, cancellation), and the engine expires any it still finds.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from pydantic import ValidationError

from pagefleet.daemon.config import DaemonConfig
from pagefleet.daemon.engine_client import EngineHandle
from pagefleet.daemon.engine_loop import RequestStream, StreamItem
from pagefleet.daemon.kv_stage import ByteBudget, StagePool, stage_bytes
from pagefleet.daemon.kv_transfer import (
    KVExportServer,
    KVPullError,
    KVTransfer,
    KVTransferMetrics,
    KVTransferParams,
    TcpKVTransfer,
)
from pagefleet.daemon.step_trace import ImportTrace
from pagefleet.engine.sampling_params import SamplingParams
from pagefleet.httpauth import (
    ENV_KV_SECRET,
    ENV_KV_SECRET_FILE,
    TransferClaims,
    TransferSigner,
    kv_secret_from_env,
)
from pagefleet.ratelog import EveryInterval

logger = logging.getLogger(__name__)

# How often an idle engine frees pulled and expired handles.
_COLLECT_EVERY_S = 1.0
# Pull failures after which a release request would find nothing or reach nobody, or
# (busy) whose handle another pull is taking: that pull settles it.
_NOTHING_TO_RELEASE = frozenset({"not_found", "unreachable", "bad_params", "busy"})
# A handle a caller names for its prefill (it becomes the engine's request id).
_HANDLE = re.compile(r"[A-Za-z0-9._:-]{1,128}")
# A reservation with less than this left after the wait for a pending prefill is renewed
# (the side write refuses one about to expire).
_MIN_RESERVATION_LEFT_S = 10.0
# Bytes the pulls in flight may stage at once (each its payload, rounded up to the stage
# pool's grain): beyond it a pull waits for room, up to its own timeout, then the request
# prefills locally (``staging_full``). A pull larger than this alone still goes.
_PULL_STAGING_BYTES = 1 << 30
# Slack on a signature's expiry for clocks of two pods that disagree.
_CLOCK_SKEW_S = 30


@dataclass(slots=True, frozen=True)
class _Admission:
    """One engine request as ``PDSide.admit`` was given it."""

    rid: str
    ids: list[int]
    params: SamplingParams
    queue: asyncio.Queue[StreamItem | BaseException]
    lora_id: str | None


class TransferParamsError(ValueError):
    """``kv_transfer_params`` the caller sent that this pod cannot honour (a 400)."""


class PDSide:
    """Transfer params in, KV out (prefill) or in (decode), for one daemon."""

    def __init__(
        self,
        config: DaemonConfig,
        registry: Any,
        labels: tuple[str, ...],
        label_values: list[str],
        engine_loop: Callable[[], EngineHandle | None],
        transfer: KVTransfer | None = None,
        upstream_key: str | None = None,
        signer: TransferSigner | None = None,
    ) -> None:
        """``upstream_key``: what this pod presents to the prefill pods' ``/v1/kv/*``
        (they require one when they have API keys); None: nothing. ``signer``: the fleet's
        P/D secret (default: from ``PAGEFLEET_KV_TRANSFER_SECRET(_FILE)``, None without)."""
        self.config = config
        if signer is None:
            secret = kv_secret_from_env()
            signer = None if secret is None else TransferSigner(secret)
        self.signer = signer
        self._unsigned_log = EveryInterval(logger, 60.0)
        self._engine_loop = engine_loop
        self.metrics = KVTransferMetrics(
            registry, labels, label_values, self._expired_total, self._active_handles
        )
        self.transfer = transfer or TcpKVTransfer(
            timeout_s=config.kv_pull_timeout_s, metrics=self.metrics, api_key=upstream_key
        )
        self.export_server = KVExportServer(
            self._kv_source, self._collect, self.metrics, config.kv_transfer_timeout_s
        )
        self._timer: asyncio.Task[None] | None = None
        self._releases: set[asyncio.Task[bool]] = set()
        # Handles of exports whose HTTP request is running here (claim .. export_ended).
        self._claimed: set[str] = set()
        # Handles this pod is importing (from the reservation to the commit), by where they
        # are: a second request naming one (a replay) prefills here rather than pull the
        # same KV again into a stage of its own.
        self._importing: set[tuple[str | None, int | None, str | None]] = set()
        # Pulls land in reused shared-memory stages (kv_stage.StagePool: a new one per pull
        # cost the decode core ~17 ms of CPU).
        self.stages = StagePool()
        self.pull_budget = ByteBudget(_PULL_STAGING_BYTES)
        self._trace = ImportTrace.from_env()  # None unless PAGEFLEET_STEP_TRACE is set

    # -- lifecycle ------------------------------------------------------------------------

    def add_routes(self, app: web.Application) -> None:
        self.export_server.add_routes(app)

    async def start(self) -> None:
        if self.signer is None:
            logger.warning(
                "no P/D secret (%s / %s): kv_transfer_params are not verified, so whoever "
                "reaches this daemon can make it pull KV from any host (presenting its "
                "upstream API key there) and plant KV in its cache; give every daemon and "
                "gateway of the fleet the same secret",
                ENV_KV_SECRET, ENV_KV_SECRET_FILE,
            )  # fmt: skip
        self._timer = asyncio.create_task(self._collect_loop(), name="pd-collect")

    async def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._timer
        if self._releases:  # each is bounded by its own short timeout
            await asyncio.gather(*self._releases, return_exceptions=True)
        self.stages.close()
        self.export_server.close()
        await self.transfer.close()

    def _loaded(self) -> EngineHandle | None:
        loop = self._engine_loop()
        return None if loop is None or not loop.loaded.is_set() or loop.dead else loop

    def _kv_source(self) -> Any:
        loop = self._loaded()
        return None if loop is None else loop.kv_source()

    def _collect(self) -> None:
        loop = self._loaded()
        if loop is not None and loop.alive:
            loop.post_collect_transfers()

    def _expired_total(self) -> float:
        loop = self._loaded()
        return 0.0 if loop is None else loop.exports_expired_total()

    def _active_handles(self) -> float:
        loop = self._loaded()
        return 0.0 if loop is None else loop.exports_live()

    def _release_remote(self, tp: KVTransferParams) -> None:
        """Free ``tp``'s handle on the prefill pod, without delaying this request."""
        task = asyncio.create_task(self.transfer.release(tp), name="kv-release")
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)

    async def _collect_loop(self) -> None:
        while True:
            await asyncio.sleep(_COLLECT_EVERY_S)
            self._collect()
            self.export_server.expire_staged()

    # -- requests -------------------------------------------------------------------------

    def parse(self, raw: Any, n: int, num_prompts: int) -> KVTransferParams | None:
        """The request's ``kv_transfer_params`` (None when absent or asking nothing);
        TransferParamsError for a malformed object or a combination this pod cannot serve."""
        if raw is None:
            return None
        if not isinstance(raw, dict):
            raise TransferParamsError("kv_transfer_params must be an object")
        try:
            tp = KVTransferParams.model_validate(raw)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(x) for x in first["loc"])
            raise TransferParamsError(f"kv_transfer_params.{where}: {first['msg']}") from None
        if tp.do_remote_decode and tp.do_remote_prefill:
            raise TransferParamsError(
                "kv_transfer_params cannot ask for do_remote_decode and do_remote_prefill at once"
            )
        if tp.do_remote_decode:
            if self.config.role == "decode":
                raise TransferParamsError(
                    "this pod has role decode; send do_remote_decode to a prefill pod"
                )
            if n != 1 or num_prompts != 1:
                raise TransferParamsError(
                    "do_remote_decode needs one prompt and n=1 (the decode pod samples n)"
                )
            if tp.remote_request_id is not None and not _HANDLE.fullmatch(tp.remote_request_id):
                raise TransferParamsError(
                    "kv_transfer_params.remote_request_id (the handle to export under) must "
                    "be 1-128 characters of letters, digits and . _ : -"
                )
        if not (tp.do_remote_decode or tp.do_remote_prefill):
            return None
        if tp.do_remote_prefill and self.signer is not None and not self._signed_live(tp):
            return None  # prefilled here: the handle expired with its signature
        return tp

    def _claims(self, tp: KVTransferParams) -> TransferClaims:
        return TransferClaims(
            handle=tp.remote_request_id or "",
            host=tp.remote_host or "",
            port=tp.remote_port or 0,
            engine_id=tp.remote_engine_id,
            block_ids=tp.remote_block_ids,
            namespace=self.config.namespace,
            expires_at=tp.remote_expires_at or 0,
        )

    def _signed_live(self, tp: KVTransferParams) -> bool:
        """Whether ``tp`` was signed by this fleet and has not expired.

        Unsigned params (neither ``remote_signature`` nor ``remote_expires_at``) are
        prefilled here (``unsigned``): nothing is contacted, and a gateway of the fleet
        that does not have the secret yet (a rolling update that reached this pod first)
        costs its clients no error. Half-signed, altered or foreign-signed params are a
        TransferParamsError (a 400: nothing was contacted either)."""
        assert self.signer is not None
        present = [tp.remote_signature is not None, tp.remote_expires_at is not None]
        if not any(present):
            self.metrics.failed("unsigned")
            self.metrics.outcome("fallback")
            self._unsigned_log.log(
                logging.WARNING,
                "kv_transfer_params without a signature (handle %s); prefilling locally: "
                "every daemon and gateway of the fleet needs the same %s",
                tp.remote_request_id, ENV_KV_SECRET,
            )  # fmt: skip
            return False
        for name in ("remote_signature", "remote_expires_at"):
            if getattr(tp, name) is None:
                raise TransferParamsError(
                    f"kv_transfer_params.{name} is missing: this daemon pulls KV only with "
                    "params signed by its fleet (send the object a prefill pod of the fleet "
                    f"returned, unchanged; pods and gateways share {ENV_KV_SECRET})"
                )
        if not self.signer.verify(self._claims(tp), tp.remote_signature or ""):
            raise TransferParamsError(
                "kv_transfer_params.remote_signature does not verify: the params were "
                "changed after signing, or signed with another secret (every daemon and "
                f"gateway of one fleet needs the same {ENV_KV_SECRET})"
            )
        if (tp.remote_expires_at or 0) + _CLOCK_SKEW_S < time.time():
            self.metrics.failed("expired")
            self.metrics.outcome("fallback")
            logger.info(
                "kv_transfer_params of handle %s expired at %d; prefilling locally",
                tp.remote_request_id, tp.remote_expires_at,
            )  # fmt: skip
            return False
        return True

    async def admit(
        self,
        loop: EngineHandle,
        rid: str,
        ids: list[int],
        params: SamplingParams,
        queue: asyncio.Queue[StreamItem | BaseException],
        tp: KVTransferParams | None,
        lora_id: str | None = None,
    ) -> RequestStream:
        """Admit one engine request as ``tp`` says (export, import, or plain)."""
        if tp is not None and tp.do_remote_decode:
            self.metrics.outcome("exported")
            # A decode pod told of this handle early waits for it (``export_ended`` or
            # ``response_params`` settles it).
            self.export_server.expect(rid)
            # The engine gathers the prompt's KV into this stage as it finishes: the pull
            # then streams it out instead of waiting for a forward to gather it.
            stage = None
            # Only an engine in another process reads through stages (ClientKVSource).
            layout = loop.kv_layout() if hasattr(loop.kv_source(), "read_stage") else None
            if layout is not None:
                nblocks = -(-len(ids) // layout.block_size)
                stage = self.export_server.stage_export(
                    rid, stage_bytes(layout, nblocks), loop.new_stage
                )
            try:
                return await loop.add_request(
                    rid, ids, params, lora_id=lora_id, queue=queue, kv_export=True,
                    export_stage=None if stage is None else stage.path,
                )  # fmt: skip
            except BaseException:
                self.export_server.staged(rid, filled=False)
                raise
        if tp is not None and tp.do_remote_prefill:
            req = _Admission(rid, ids, params, queue, lora_id)
            stream = await self._import(loop, req, tp)
            if stream is not None:
                return stream
        return await loop.add_request(rid, ids, params, lora_id=lora_id, queue=queue)

    async def _import(
        self, loop: EngineHandle, req: _Admission, tp: KVTransferParams
    ) -> RequestStream | None:
        """Pull and commit; None (reservation released, reason counted) to prefill here."""
        key = (tp.remote_host, tp.remote_port, tp.remote_request_id)
        if key in self._importing:
            self._fallback(req.rid, "busy", "another request here is pulling this handle", tp)
            return None
        self._importing.add(key)
        try:
            return await self._pull_and_commit(loop, req, tp)
        finally:
            self._importing.discard(key)

    async def _pull_and_commit(
        self, loop: EngineHandle, req: _Admission, tp: KVTransferParams
    ) -> RequestStream | None:
        rid, ids, params, queue, lora_id = req.rid, req.ids, req.params, req.queue, req.lora_id
        if tp.remote_num_tokens is not None and tp.remote_num_tokens != len(ids):
            self._fallback(rid, "prompt_mismatch", "the handle holds another prompt", tp)
            return None
        times = [time.monotonic()]  # start, reserved, [ready,] pulled, written, committed
        plan = await loop.reserve_import(rid, ids, lora_id)
        times.append(time.monotonic())
        if tp.remote_pending:
            # The prefill may still be running: the reservation above overlapped it; now
            # wait for its handle. One that could not be made, or would expire too soon
            # for the copy, is made again once the KV is there.
            wait_s = self.config.kv_transfer_timeout_s
            if tp.remote_wait_s is not None:  # the sender's own bound, from our start
                wait_s = min(wait_s, max(0.05, tp.remote_wait_s - (times[1] - times[0])))
            try:
                await self.transfer.wait_ready(tp, wait_s)
            except KVPullError as exc:
                if plan is not None:
                    loop.post_cancel_import(plan)
                self._fallback(rid, exc.reason, str(exc), tp)
                return None
            except BaseException:
                if plan is not None:
                    loop.post_cancel_import(plan)
                self._release_remote(tp)  # the caller left: nobody here will pull it
                raise
            if plan is None or plan.deadline - time.monotonic() < _MIN_RESERVATION_LEFT_S:
                if plan is not None:
                    loop.post_cancel_import(plan)
                plan = await loop.reserve_import(rid, ids, lora_id)
            times.append(time.monotonic())
        if plan is None:
            self._fallback(rid, "no_reservation", "no blocks free for the pull now", tp)
            return None
        committed = False
        engine_saw_stage = False  # the engine may read the stage: never reuse it then
        stage = None
        granted = 0  # bytes of ``pull_budget`` this pull holds
        try:
            kv = None
            if plan.num_pull_blocks:
                layout = loop.kv_layout()
                nbytes = stage_bytes(layout, plan.num_pull_blocks)
                need = -(-nbytes // self.stages.grain) * self.stages.grain
                if not await self.pull_budget.take(need, self.config.kv_pull_timeout_s):
                    self._fallback(
                        rid, "staging_full", f"{self.pull_budget.used} bytes of pulled KV "
                        f"staged already (at most {self.pull_budget.limit})", tp,
                    )  # fmt: skip
                    return None
                granted = need
                # An engine in another process reads the pulled bytes from shared memory.
                stage = self.stages.take(nbytes, loop.new_stage)
                try:
                    kv = await self.transfer.pull(tp, plan, layout, into=stage)
                except KVPullError as exc:
                    self._fallback(rid, exc.reason, str(exc), tp)
                    return None
            else:
                self._release_remote(tp)  # every block is in this pod's own cache
            times.append(time.monotonic())
            engine_saw_stage = True
            # With a stage: copied into the reserved blocks on a thread of the engine
            # process as the call arrives, while it steps (no step waits for it), and
            # committed at the first step boundary after the copy, in the same call (no
            # round trip through this process between the two). The trace's "written"
            # is then the pull's end: its "commit" is the copy and the commit.
            write_first = stage is not None and plan.num_pull_blocks > 0
            times.append(time.monotonic())
            stream = await loop.add_import(
                rid, plan, kv, params, queue, stage=stage, write_first=write_first
            )
            committed = True
            if self._trace is not None:
                times.append(time.monotonic())
                line = {"rid": rid, "n": len(ids), "blocks": plan.num_pull_blocks, "t": times,
                        "handle": tp.remote_request_id}  # fmt: skip
                if tp.remote_pending:
                    line["pending"] = True  # t: start, reserved, ready, pulled, ...
                self._trace.add(line)
            self.metrics.outcome("pulled" if plan.num_pull_blocks else "local_hit")
            return stream
        except ValueError as exc:  # the reservation expired meanwhile
            self._fallback(rid, "reservation_expired", str(exc), tp)
            return None
        except BaseException:
            # Cancelled (the client left) mid-pull or mid-commit: unless the commit took
            # the bytes, no pull of this handle will come from here; without this its
            # blocks stayed pinned on the prefill pod until the handle's deadline. (Pulled
            # already: the release finds nothing, harmless.)
            if not committed:
                self._release_remote(tp)
            raise
        finally:
            if granted:
                self.pull_budget.give(granted)
            if stage is not None:
                del kv  # views of the stage
                # A commit that returned has copied the stage into the pool; one that
                # failed or was cancelled may still be read by the engine: not reused.
                if committed or not engine_saw_stage:
                    self.stages.give_back(stage)
                else:
                    stage.close()
            if not committed:
                loop.post_cancel_import(plan)

    def claim(self, rid: str) -> bool:
        """Take handle ``rid`` for one export request; False when another request here runs
        or holds it (a caller-named handle used twice). Each True is paired with one
        ``export_ended``; a False must be answered without touching the handle's state, or
        the second request would end the first one's stage and wait."""
        if rid in self._claimed or self.export_server.in_use(rid):
            return False
        self._claimed.add(rid)
        return True

    def export_ended(self, rid: str) -> None:
        """The HTTP handler of exported request ``rid`` (claimed) is done (answered, failed
        or cancelled): a decode pod still waiting for its handle learns it will not come,
        and an export nobody was told of is freed now. After ``response_params`` handed it
        out, the handle stays for its decode pod."""
        self._claimed.discard(rid)
        self.export_server.settle(rid, exported=False)  # the first settle counts
        if not self.export_server.exported(rid):
            # Never handed out (a streamed request, a failure) or released while its prefill
            # ran (the release found no handle yet): no pull can come, and the blocks
            # stayed pinned to the transfer timeout.
            self.export_server.forget_stage(rid)
            loop = self._loaded()
            if loop is not None:
                loop.post_release_export(rid)

    def _fallback(self, rid: str, reason: str, message: str, tp: KVTransferParams) -> None:
        self.metrics.failed(reason)
        self.metrics.outcome("fallback")
        logger.info("request %s: KV pull failed (%s: %s); prefilling locally", rid, reason, message)
        # Nobody pulls this handle now; free it unless it is known gone or unreachable.
        if reason not in _NOTHING_TO_RELEASE and tp.remote_request_id:
            self._release_remote(tp)

    async def response_params(self, rid: str, num_tokens: int) -> dict[str, Any]:
        """What a prefill pod returns so that a decode pod can pull ``rid``'s KV."""
        loop = self._loaded()
        block_ids, filled = [], False
        try:
            if loop is not None:
                block_ids, filled = await loop.side("export_info", rid)
            self.export_server.staged(rid, filled)
        finally:
            self.export_server.settle(rid, exported=bool(block_ids))
        tp = KVTransferParams(
            do_remote_prefill=True,
            remote_engine_id=self.config.pod,
            remote_block_ids=block_ids,
            remote_host=self.config.advertise_host,
            remote_port=self.config.port,
            remote_request_id=rid,
            remote_num_tokens=num_tokens,
        )
        if self.signer is not None:
            # Valid as long as the handle can be: past its deadline it is gone anyway.
            tp.remote_expires_at = int(time.time() + self.config.kv_transfer_timeout_s) + 1
            tp.remote_signature = self.signer.sign(self._claims(tp))
            return tp.model_dump()
        return tp.model_dump(exclude={"remote_expires_at", "remote_signature"})

"""What the migration runtime may do to its llumlet (`MigrationHooks`): route a request's output
away or to here, wake the engine, ask for a report, fail a request."""

from __future__ import annotations

from typing import Protocol

from services.llumlet.metrics import LlumletMetrics
from services.llumlet.output import OutputPublisher
from services.llumlet.routes import OutputRoutes
from services.llumlet.tracing import RequestSpans
from shared.messages import InstanceRole, MigrationCommit, TokenChunk, encode
from shared.policy.disaggregation import wants_handoff


class HookedLlumlet(Protocol):
    """The llumlet's surface the hooks use (`Llumlet`; no import of it: no cycle)."""

    instance_id: str
    role: InstanceRole
    draining: bool
    routes: OutputRoutes
    output: OutputPublisher
    metrics: LlumletMetrics | None
    spans: RequestSpans

    def wake_engine(self) -> None: ...

    def report_soon(self) -> None: ...

    async def fail_request(self, request_id: str, reason: str) -> None: ...


class LlumletMigrationHooks:
    """The llumlet's side of `MigrationHooks`, through its public surface only."""

    def __init__(self, llumlet: HookedLlumlet) -> None:
        self.llumlet = llumlet

    def refusal(self) -> str | None:
        if wants_handoff(self.llumlet.role):
            return f"{self.llumlet.role} instance: it hands requests off and takes none in"
        return "draining" if self.llumlet.draining else None

    def migrated_out(self, request_id: str) -> None:
        self.llumlet.routes.close(request_id)  # the destination publishes from now on
        self.llumlet.metrics.request_left(request_id)
        self.llumlet.metrics.migrated("out")
        self.llumlet.spans.ended(request_id, "migrated_out")

    def resumed(self) -> None:
        self.llumlet.wake_engine()

    def changed(self) -> None:
        self.llumlet.report_soon()

    async def fail_request(self, request_id: str, reason: str) -> None:
        await self.llumlet.fail_request(request_id, reason)

    async def migrated_in(self, commit: MigrationCommit) -> None:
        """Publish from now on; first, everything output so far: the source may not have
        published its last token before it stopped (the gateway drops what it has seen)."""
        llumlet, request = self.llumlet, commit.request
        llumlet.routes.open(request.request_id, request.reply_subject, request.resume_from)
        if request.batched_output:
            llumlet.output.batch_for(request.reply_subject)
        llumlet.metrics.migrated("in")
        llumlet.spans.started(request, migrated_in=True, num_output_tokens=len(commit.output_token_ids))
        llumlet.wake_engine()
        llumlet.report_soon()
        for catch_up in catch_up_chunks(llumlet.instance_id, commit):
            await llumlet.output.publish_chunk(request.reply_subject, encode(catch_up))


def catch_up_chunks(instance_id: str, commit: MigrationCommit) -> list[TokenChunk]:
    """The destination's first chunks: the output so far, in order (at least one chunk, even
    empty: it hands the stream over). The source's last step may reach the gateway after them,
    so its tokens go in a chunk of their own with the logprobs the commit carries; the tokens
    before them, streamed by the source's earlier steps, have none here."""
    request, outputs, tail = commit.request, commit.output_token_ids, commit.tail_logprobs or []
    split = len(outputs) - len(tail)
    parts = [(0, split, None)] if split or not tail else []
    if tail:
        parts.append((split, len(outputs), tail))
    return [
        TokenChunk(
            request_id=request.request_id,
            instance_id=instance_id,
            start_index=request.resume_from + start,
            token_ids=outputs[start:end],
            num_prompt_tokens=len(request.prompt_token_ids) - request.resume_from,
            num_preemptions=commit.num_preemptions,
            handover=True,
            handover_from=commit.source_instance_id,
            logprobs=logprobs,
        )
        for start, end, logprobs in parts
    ]

"""What happened to whom: the events a step reports (`ReqOutput`s: one per new token, exactly one
terminal event per request), and the live requests (added, not ended yet)."""

from __future__ import annotations

from minisgl.core import FinishReason, Req, ReqOutput


class Outputs:
    def __init__(self) -> None:
        self.events: list[ReqOutput] = []  # a new token's is added by Scheduler._take
        # Every request added and not yet ended, by rid: after a failed step, any of them that is
        # neither waiting nor running (caught between the two) still gets its one terminal event.
        self.live: dict[str, Req] = {}

    def __bool__(self) -> bool:
        return bool(self.events)

    def end(self, req: Req, reason: FinishReason, error: str | None = None) -> None:
        """The end of a request without a new token: aborted, failed (`error`, the server's),
        or done scoring its prompt (max_tokens 0: it ends here with its prompt logprobs)."""
        req.finish_reason, req.grammar = reason, None
        only_scored = reason == FinishReason.LENGTH and not req.output_ids
        self.events.append(
            ReqOutput(
                req.rid, (), reason, (), req.prompt_len, req.num_cached_prompt_tokens,
                error=error, internal_error=error is not None,
                prompt_logprobs=tuple(req.prompt_logprobs) if only_scored else (),
            )
        )  # fmt: skip

    def ended_rids(self) -> set[str]:
        """Requests whose terminal event is among the events not taken yet."""
        return {out.rid for out in self.events if out.finish_reason is not None}

    def take(self) -> list[ReqOutput]:
        events, self.events = self.events, []
        for out in events:
            if out.finish_reason is not None:
                self.live.pop(out.rid, None)
        return events

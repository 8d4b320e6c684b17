"""Per-request bookkeeping between sampled tokens and `RequestOutput`s: text, stop strings, deltas."""

from __future__ import annotations

import bisect
import time

from loraplex.engine.detokenizer import IncrementalDetokenizer, StopStringMatcher
from loraplex.engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput, TokenLogprobs
from loraplex.engine.sampling_params import SamplingParams
from loraplex.engine.sequence import Sequence
from loraplex.engine.tokenizer import Tokenizer


class CompletionState:
    """One of a request's n completions: its sequence plus the text produced so far."""

    def __init__(self, seq: Sequence, tokenizer: Tokenizer | None, prompt_ids: list[int]):
        self.seq = seq
        p = seq.params
        self.detok = (
            IncrementalDetokenizer(tokenizer, prompt_ids, p.skip_special_tokens) if tokenizer is not None else None
        )
        self.stops = StopStringMatcher(p.stop_strings, p.include_stop_str_in_output)
        self.text = ""
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprobs] | None = [] if p.logprobs is not None else None
        # where each logprobs entry's text begins in the decoded text (before stop strings cut it), and how
        # much text was decoded; whether the stop token that ended the completion was kept out of its text
        self.logprob_starts: list[int] = []
        self.decoded_chars = 0
        self.hid_stop_token = False
        self.cumulative_logprob: float | None = 0.0 if p.logprobs is not None else None
        # how much of the above the previous RequestOutput already carried
        self.sent_text = 0
        self.sent_tokens = 0
        self.sent_logprobs = 0


class RequestState:
    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        seqs: list[Sequence],
        tokenizer: Tokenizer | None,
        *,
        eos_token_ids: tuple[int, ...] = (),
        max_model_len: int,
    ):
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = max_model_len
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.tokenizer = tokenizer
        self.completions = [CompletionState(s, tokenizer, prompt_token_ids) for s in seqs]
        self.metrics = RequestMetrics(arrival_time=time.time())
        self.error: str | None = None
        self.error_kind: str | None = None

    @property
    def seqs(self) -> list[Sequence]:
        return [c.seq for c in self.completions]

    @property
    def finished(self) -> bool:
        return all(c.seq.is_finished for c in self.completions)

    def on_token(self, comp: CompletionState, token: int, logprob) -> tuple[str, int | str] | None:
        """Record a sampled token. Returns (finish_reason, stop_reason) when the completion ends here."""
        seq, p = comp.seq, comp.seq.params
        now = time.time()
        if self.metrics.first_token_time is None:
            self.metrics.first_token_time = now
        comp.token_ids.append(token)
        if logprob is not None and comp.logprobs is not None:
            chosen, top = logprob
            comp.cumulative_logprob += chosen
            comp.logprobs.append(
                TokenLogprobs(
                    chosen=self._logprob(token, chosen),
                    top=[self._logprob(t, lp) for t, lp in top],
                )
            )
            comp.logprob_starts.append(self._text_start(comp, token))
        finish: tuple[str, int | str] | None = None
        is_eos = token in self.eos_token_ids and not p.ignore_eos
        min_reached = seq.num_output_tokens >= p.min_tokens
        if min_reached and (is_eos or token in p.stop_token_ids):
            finish = ("stop", token)
        elif p.max_tokens is not None and seq.num_output_tokens >= p.max_tokens:
            finish = ("length", None)
        elif len(seq.token_ids) >= self.max_model_len:
            finish = ("length", None)
        # A stop token is not shown as text (unless it is an ordinary token and asked for).
        hide = finish is not None and finish[0] == "stop" and not p.include_stop_str_in_output
        comp.hid_stop_token = hide
        if self.tokenizer is not None:
            delta = "" if hide else comp.detok.step([token])
            if finish is not None:
                delta += comp.detok.flush()  # text held for a character's next piece, which will not come
            comp.decoded_chars += len(delta)
            # before min_tokens no stop string is looked for (as vLLM); text that could begin one is held
            emit, matched = comp.stops.feed(delta, match=min_reached)
            comp.text += emit
            if matched is not None:
                return ("stop", matched)
            if finish is not None:
                comp.text += comp.stops.flush()
        return finish

    def _text_start(self, comp: CompletionState, token: int) -> int:
        """Where the token's text begins in the completion's decoded text: after the text emitted so far and
        the text held back of the tokens before it, or at the held character it completes."""
        if comp.detok is None:
            return comp.decoded_chars
        held = comp.detok.held_text()
        start = comp.decoded_chars + len(held)
        raw = self.tokenizer.token_bytes(token) if held.endswith("\ufffd") else b""
        return start - 1 if raw and raw[0] & 0xC0 == 0x80 else start

    def _token_text(self, token: int) -> str:
        return "" if self.tokenizer is None else self.tokenizer.token_text(token)

    def _logprob(self, token: int, logprob: float) -> Logprob:
        text = self._token_text(token)
        raw = list(self.tokenizer.token_bytes(token)) if "\ufffd" in text else None
        return Logprob(token, text, logprob, token_bytes=raw)

    def _logprobs_shown(self, comp: CompletionState) -> int:
        """How many of the completion's logprobs entries its output shows: those of the tokens its text is
        made of (OpenAI's logprobs cover the content's tokens). Left out are the stop token (EOS) that ended it
        unseen, and after a stop string the tokens whose text lies wholly in the stop string or beyond it; a
        token that straddles the cut stays, since part of its text is in the content. While the completion
        runs, an entry whose text is held back (it may begin a stop string) waits with that text."""
        entries = len(comp.logprobs)
        if comp.hid_stop_token:
            return entries - 1
        if self.tokenizer is None or not comp.stops.stop or (comp.seq.is_finished and comp.stops.matched is None):
            return entries
        # the entries whose text begins before the end of the text released so far
        return bisect.bisect_left(comp.logprob_starts, len(comp.text))

    def make_output(self, *, final_only_deltas: bool = False) -> RequestOutput:
        outputs = []
        for i, comp in enumerate(self.completions):
            seq = comp.seq
            out = CompletionOutput(
                index=i,
                text=comp.text,
                token_ids=list(comp.token_ids),
                cumulative_logprob=comp.cumulative_logprob,
                finish_reason=seq.finish_reason,
                stop_reason=seq.stop_reason,
            )
            out.delta_text = comp.text[comp.sent_text :]
            out.delta_token_ids = comp.token_ids[comp.sent_tokens :]
            if comp.logprobs is not None:
                shown = self._logprobs_shown(comp)
                out.logprobs = comp.logprobs[:shown]
                out.delta_logprobs = comp.logprobs[comp.sent_logprobs : shown]
                comp.sent_logprobs = shown
            comp.sent_text, comp.sent_tokens = len(comp.text), len(comp.token_ids)
            outputs.append(out)
        finished = self.finished
        if finished and self.metrics.finished_time is None:
            self.metrics.finished_time = time.time()
        scheduled = [c.seq.first_scheduled_time for c in self.completions if c.seq.first_scheduled_time]
        if scheduled and self.metrics.first_scheduled_time is None:
            self.metrics.first_scheduled_time = min(scheduled)
        self.metrics.num_cached_tokens = max((c.seq.num_cached_tokens for c in self.completions), default=0)
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=outputs,
            finished=finished,
            metrics=self.metrics,
            error=self.error,
            error_kind=self.error_kind,
            num_prompt_tokens_processed=max((s.num_prompt_tokens_processed for s in self.seqs), default=0),
        )

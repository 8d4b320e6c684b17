"""What an engine process sends back over the wire is what the API process reads: every field of an output."""

from __future__ import annotations

import json

from loraplex.engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput, TokenLogprobs
from loraplex.platform.remote.protocol import output_from_json, output_to_json


def _round_trip(out: RequestOutput) -> RequestOutput:
    return output_from_json(json.loads(json.dumps(output_to_json(out))))


def test_a_full_output_survives_the_wire():
    lp = TokenLogprobs(chosen=Logprob(7, "a", -0.5), top=[Logprob(7, "a", -0.5), Logprob(9, "b", -1.25)])
    out = RequestOutput(
        request_id="r1", prompt="hi", prompt_token_ids=[1, 2],
        outputs=[CompletionOutput(index=0, text="ab", token_ids=[7, 8], cumulative_logprob=-1.0, logprobs=[lp],
                                  finish_reason="stop", stop_reason="\n", delta_text="b", delta_token_ids=[8],
                                  delta_logprobs=[lp])],
        finished=True, metrics=RequestMetrics(arrival_time=1.0, first_token_time=1.5, num_cached_tokens=16))
    assert _round_trip(out) == out


def test_an_adapter_load_failure_keeps_its_kind_across_the_wire():
    out = RequestOutput(request_id="r2", prompt=None, prompt_token_ids=[1],
                        outputs=[CompletionOutput(index=0, text="", token_ids=[], finish_reason="error")],
                        finished=True, error="adapter 'bot' could not be loaded: gone", error_kind="adapter_load")
    back = _round_trip(out)
    assert back == out and back.error_kind == "adapter_load"

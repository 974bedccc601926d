"""In-flight batching (backends/inflight.py): requests join a running decode batch at the next step
and leave when they end; every greedy answer equals the prompt's answer alone, whatever joins or
leaves around it, and a sampled answer depends on its own seed only."""

import numpy as np
import pytest

pytest.importorskip("onnxruntime")

from diffexport.backends.inflight import InflightBatcher, InflightRequest  # noqa: E402
from diffexport.backends.step_loop import OrtDecoder, generate_stepped  # noqa: E402
from diffexport.core.eager_generation import Sampling  # noqa: E402
from diffexport.core.errors import DiffExportError  # noqa: E402

PROMPTS = [[5, 17, 42, 99, 3, 250, 7], [9, 8, 7], [300, 12, 77, 8, 1, 2, 3, 4, 5, 6, 7, 200], [64, 2, 9, 11, 5],
           [1, 2, 3, 4, 5, 6, 7, 8, 9]]
LIMITS = [10, 5, 14, 6, 3]


@pytest.mark.parametrize("attention", ["diffattention", "gqa"])
def test_rows_that_join_and_leave_answer_as_alone(artifacts, attention):
    """Two requests start; three more arrive while they decode, one of them waiting for a free row
    (max 3 rows); rows of different past lengths decode together, and each leaves when it ends."""
    folder = artifacts.decoder("diff-v1-gqa", attention)
    runner = OrtDecoder(folder)
    alone = [generate_stepped(folder, p, n, Sampling(), runner=runner) for p, n in zip(PROMPTS, LIMITS)]
    batcher = InflightBatcher(runner, max_rows=3)
    requests = [InflightRequest(p, n) for p, n in zip(PROMPTS, LIMITS)]
    batcher.submit(requests[0])
    batcher.submit(requests[1])
    widths = []
    for _ in range(3):
        batcher.step()
    assert len(requests[0].tokens) == 4 and len(batcher.rows) == 2  # running when the others arrive
    for request in requests[2:]:
        batcher.submit(request)
    while batcher.busy:
        batcher.step()
        widths.append(len(batcher.rows))
    assert 3 in widths and 1 in widths and widths[-1] == 0  # a full batch, rows that left, then none
    for request, run in zip(requests, alone):
        assert (request.tokens, request.stop) == (run.tokens, run.stop)
    assert batcher.cache.held == 0 and batcher.mask is None  # every row gone, nothing held


@pytest.mark.parametrize("attention", ["diffattention", "gqa"])
def test_long_prompts_join_a_chunk_per_step(artifacts, attention):
    """While rows run, a joining prompt is prefilled a few tokens per step and the running rows keep
    decoding meanwhile; answers stay those of each prompt alone. The gqa folder's rows live in
    buffers written in place, which grow past their first capacity here (prompts of 70+ tokens)."""
    folder = artifacts.decoder("diff-v1-gqa", attention)
    runner = OrtDecoder(folder)
    prompts = [PROMPTS[1], [(7 * i + 3) % 500 for i in range(75)], [(11 * i + 1) % 500 for i in range(41)]]
    limits = [12, 5, 6]
    alone = [generate_stepped(folder, p, n, Sampling(), runner=runner) for p, n in zip(prompts, limits)]
    batcher = InflightBatcher(runner, max_rows=3, prefill_chunk=16)
    requests = [batcher.submit(InflightRequest(p, n)) for p, n in zip(prompts, limits)]
    batcher.step()
    # the first prompt prefilled whole (nothing ran), then the second's first chunk, then a decode step
    assert [len(r.tokens) for r in requests] == [2, 0, 0] and batcher.joining.done == 16
    batcher.step()
    assert batcher.joining.done == 32 and len(requests[0].tokens) == 3
    batcher.run()
    for request, run in zip(requests, alone):
        assert (request.tokens, request.stop) == (run.tokens, run.stop)
    assert runner.writes_in_place is (attention == "gqa")
    if attention == "gqa":
        assert batcher.cache.capacity >= 75 + 5 and batcher.cache.held == 0


def test_a_sampled_answer_depends_on_its_own_seed_only(artifacts):
    folder = artifacts.decoder("diff-v1-gqa", "gqa")
    runner = OrtDecoder(folder)

    def answer(seed: int, with_others: bool) -> list[int]:
        batcher = InflightBatcher(runner, max_rows=4)
        if with_others:
            batcher.submit(InflightRequest(PROMPTS[2], 6, Sampling(greedy=False, temperature=1.0, seed=3)))
            batcher.step()
        mine = batcher.submit(InflightRequest(PROMPTS[0], 10, Sampling(greedy=False, temperature=1.5, top_k=50,
                                                                        seed=seed)))
        if with_others:
            batcher.submit(InflightRequest(PROMPTS[3], 4))
        batcher.run()
        return mine.tokens

    alone = answer(11, with_others=False)
    assert len(alone) == 10 and answer(11, with_others=True) == alone
    assert answer(12, with_others=False) != alone  # another seed draws otherwise: the comparison could fail


def test_a_row_that_asks_to_stop_frees_its_place_at_once(artifacts):
    """on_token returning True (a stop string, a client gone) ends that row in the same step; the
    others go on, and the cache's columns only it used are cut from the left."""
    folder = artifacts.decoder("diff-v1-gqa", "diffattention")
    runner = OrtDecoder(folder)
    seen = []
    leaving = InflightRequest(PROMPTS[2], 20, on_token=lambda token: seen.append(token) or len(seen) == 3)
    staying = InflightRequest(PROMPTS[1], 8)
    batcher = InflightBatcher(runner, max_rows=2)
    batcher.submit(leaving)
    batcher.submit(staying)
    while leaving.stop is None:
        batcher.step()
    assert leaving.stop == "stop_string" and leaving.tokens == seen and len(seen) == 3
    assert len(batcher.rows) == 1 and batcher.mask.shape[1] == len(PROMPTS[1]) + len(staying.tokens) - 1
    batcher.run()
    assert staying.tokens == generate_stepped(folder, PROMPTS[1], 8, Sampling(), runner=runner).tokens


def test_requests_out_of_bounds_are_refused_before_they_queue(artifacts):
    runner = OrtDecoder(artifacts.decoder("diff-v1-gqa", "gqa"))
    batcher = InflightBatcher(runner)
    for request, message in [(InflightRequest([], 4), "a prompt needs 1 to"),
                             (InflightRequest([1] * runner.context, 4), "a prompt needs 1 to"),
                             (InflightRequest([10**6], 4), "a prompt's ids must lie in"),
                             (InflightRequest([1, 2], 0), "max_new_tokens must be >= 1")]:
        with pytest.raises(DiffExportError, match=message):
            batcher.submit(request)
    assert not batcher.busy
    with pytest.raises(DiffExportError, match="at least one row"):
        InflightBatcher(runner, max_rows=0)
    with pytest.raises(DiffExportError, match="prefill_chunk must be >= 1"):
        InflightBatcher(runner, prefill_chunk=0)
    with pytest.raises(DiffExportError, match="exceed the folder's context length"):
        runner.step_in_place(np.ones((1, 1), np.int64), np.ones((1, runner.context + 1), np.int64), {})
    returning = OrtDecoder(artifacts.decoder("diff-v1-gqa", "diffattention"))
    with pytest.raises(DiffExportError, match="no shared past/present buffer"):
        returning.step_in_place(np.ones((1, 1), np.int64), np.ones((1, 1), np.int64), {})

"""U1 for the masked-LM family: K masked-LM microbatches in one window give the same
update as one batch of all their rows (fp32, 1e-5), on the bidirectional encoder.

The one batch is compiled by the same compiler from the same planned rows; because
the masks are addressed by piece, it holds exactly the microbatches' corruptions.
Negative control: each microbatch's own token mean divided by K (the mean of means)
moves the parameters elsewhere.
"""

from __future__ import annotations

from mlm_support import compile_rows, compiler, plan, random_examples
from update.test_real_stack import real_engine

from exactstep.config import load_config
from exactstep.families.mlm.family import build_encoder
from exactstep.objective import plan_window
from exactstep.update.disposition import Outcome

SEQ_LEN = 32


def window(k: int = 3, rows: int = 2):
    examples = random_examples(24, seed=7, lo=4, hi=45)
    planned = plan(examples, SEQ_LEN, k * rows)
    c = compiler(11)
    micro = [compile_rows(c, planned[i : i + rows], examples, SEQ_LEN)
             for i in range(0, k * rows, rows)]
    return micro, compile_rows(c, planned, examples, SEQ_LEN)


def mean_of_means(batches, cfg):
    """WRONG (U1): each microbatch's own token mean, divided by K."""
    plan = plan_window(batches, cfg)
    k = len(batches)
    coeffs = [c / max(1.0, float(c.sum())) / k for c in plan.coefficients]
    return type(plan)(coeffs, 1.0, plan.tokens, [1.0] * k, plan.row_indices,
                      plan.microbatch_tokens)


def one_update(batches, *, wrong: bool = False):
    cfg = load_config(None, ["objective.family=mlm", "model.d_model=16", "model.n_layers=1",
                             "model.n_heads=2", "model.d_ff=32", "seed=4"])
    engine = real_engine(build_encoder(cfg, 260), optimizer="sgd", lr=1.0, momentum=0.0,
                         clip=0.0, weight_decay=0.0, accum=len(batches))
    if wrong:
        engine.plan = mean_of_means
    assert engine.run_window(batches, 0).outcome is Outcome.COMMITTED
    return [p.detach().clone() for p in engine.parameters]


def largest_difference(a, b) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True))


def test_masked_lm_accumulation_equals_one_batch_u1():
    micro, whole = window()
    counts = [m.num_targets() for m in micro]
    assert len(set(counts)) > 1  # unequal microbatches: the mean of means would differ
    assert sum(counts) == whole.num_targets()
    # U1's fp32 1e-5: SGD (lr 1) moves each parameter by its gradient, whose split and whole
    # forms differ in summation order only (~1e-7 on these O(1) tiny models), two orders below
    assert largest_difference(one_update(micro), one_update([whole])) <= 1e-5


def test_the_mean_of_means_is_caught_u1():
    micro, whole = window()
    assert largest_difference(one_update(micro, wrong=True), one_update([whole])) > 1e-5

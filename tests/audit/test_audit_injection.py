"""Where the probes inject and what they call an embedding (A1, U4, U6).

``decay_groups`` decides what a lookup table is by behaviour (the forward reads it with
``aten.embedding`` or integer indexing), so a table held as an ``nn.Parameter`` counts;
the skip probes inject at the lookup of a marked window's ids wherever it happens
(``nn.Embedding``, ``F.embedding``, ``model.forward`` called directly), check that the
injection fired, and are N/A with the reason when the model never looks its tokens up.
"""

from __future__ import annotations

import audit_correct_loops as correct
import torch
import torch.nn.functional as F
from torch import nn

from exactstep.audit import reference as ref
from exactstep.audit.examples.nanogpt import NanoGPTLoop
from exactstep.audit.probes import NA, PASS, SPEC, plain_rows
from exactstep.audit.protocol import ProbeSpec
from exactstep.audit.run import run_audit


def test_lookup_tables_are_found_by_behaviour_not_by_module_type() -> None:
    """The tables by construction: nanoGPT's ``wte`` (an ``nn.Embedding`` tied to the
    head) and ``wpe``; the functional variant's ``wte``/``wpe`` parameters; no matrix
    used only in a product (negative control: ``c_attn``, ``mlp``)."""
    mb = plain_rows()
    module_loop, functional_loop = NanoGPTLoop(), correct.FunctionalEmbedding()
    module_loop.build(SPEC)
    functional_loop.build(SPEC)
    assert ref.lookup_tables(module_loop, mb) == {"wte.weight", "wpe.weight"}
    assert ref.lookup_tables(functional_loop, mb) == {"wte", "wpe"}
    decays = ref.decays(functional_loop, mb)
    assert not decays["wte"] and not decays["wpe"] and not decays["ln_f.weight"]
    assert decays["h.0.attn.c_attn.weight"] and decays["h.0.mlp.0.weight"]


class BareModel(nn.Module):
    """No submodules: one token table and a head; ``one_hot`` reads the table by a
    product instead of a lookup."""

    one_hot = False

    def __init__(self, spec: ProbeSpec, block_size: int = 64) -> None:
        super().__init__()
        self.vocab_size = spec.vocab_size
        self.wte = nn.Parameter(torch.randn(spec.vocab_size, spec.d_model) * 0.02)
        self.head = nn.Parameter(torch.randn(spec.vocab_size, spec.d_model) * 0.02)

    def forward(self, idx: torch.Tensor, pos: torch.Tensor,
                documents: torch.Tensor) -> torch.Tensor:
        if self.one_hot:
            x = F.one_hot(idx, self.vocab_size).float() @ self.wte
        else:
            x = F.embedding(idx, self.wte)
        return F.linear(torch.tanh(x), self.head)


class OneHotModel(BareModel):
    one_hot = True


class ThroughForward(NanoGPTLoop):
    model_type = BareModel

    def build(self, spec: ProbeSpec) -> None:
        super().build(spec)
        self.model = self.module.forward  # no hook of the model can fire


class OneHotThroughForward(ThroughForward):
    model_type = OneHotModel


def test_the_skip_injection_reaches_a_functional_table_called_through_forward() -> None:
    """``F.embedding`` in ``model.forward`` called directly: no module hook could fire,
    the lookup still does, and the correct skip passes (the false FAIL it replaces)."""
    results = run_audit(ThroughForward(), probes=["nonfinite_skip",
                                                  "nonfinite_gradient"]).results
    assert [r.status for r in results] == [PASS, PASS], [r.observed for r in results]


def test_an_injection_that_cannot_fire_is_not_applicable_not_a_fail() -> None:
    """Negative control: a model that reads its table through a one-hot product looks no
    id up; the probe says so (N/A), it does not blame the loop's skip path."""
    (result,) = run_audit(OneHotThroughForward(), probes=["nonfinite_skip"]).results
    assert result.status == NA and "never reached the loop" in result.observed

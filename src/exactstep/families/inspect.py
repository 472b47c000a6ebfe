"""``exactstep inspect`` (R6): the rows of the first microbatch a run with a configuration
would see, compiled by its family and rendered by ``rows.inspect`` (or by the family's
own ``render`` where it has more to show).
"""

from __future__ import annotations

from exactstep.config import RunConfig
from exactstep.errors import ConfigError
from exactstep.families.registry import open_family, resolve
from exactstep.rows.inspect import render_rows
from exactstep.rows.stream import RowStream, eval_batches


def inspect_rows(cfg: RunConfig, rows: range, *, split: str = "train") -> str:
    """Render rows of the first microbatch a run with ``cfg`` would see (R6).

    Raises ``ConfigError`` when ``rows`` reaches past the microbatch.
    """
    parts = open_family(resolve(cfg))
    tokenizer, data, compiler = parts.tokenizer, parts.data, parts.compiler
    if split == "train":
        batch = next(iter(RowStream(data.train, cfg.batch, pad_id=tokenizer.pad_id,
                                    seed=cfg.seed, compiler=compiler)))
    else:
        batch = next(iter(eval_batches(data.val, cfg.batch, pad_id=tokenizer.pad_id,
                                       compiler=compiler)))
    if rows.stop > batch.input_ids.shape[0]:
        raise ConfigError(f"--rows {rows.start}:{rows.stop} is outside the microbatch's "
                          f"{batch.input_ids.shape[0]} rows")
    render = getattr(compiler, "render", None)  # a family with more to show (R8)
    return render(batch, tokenizer, rows) if render else render_rows(batch, tokenizer, rows)

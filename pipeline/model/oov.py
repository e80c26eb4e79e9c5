"""Unseen values must not borrow a real value's id: the ``oov`` of a vocabulary input, checked.

``"vocabulary": brands, "oov": 0`` maps every brand the vocabulary does not hold to id 0, which
is ``brands[0]``: an unseen brand is scored exactly as "acme", and nothing in the output says
so. The safe forms are a reserved entry at the ``oov`` id (``["<unk>", *brands]`` with
``oov = 0``) or an ``oov`` beyond the vocabulary (``oov = len(brands)``) that the model's
embedding has a row for.

:func:`findings` reads a loaded bundle and returns the warnings (an ``oov`` that is a real
entry's id: scored, but wrongly, so said and not refused) and the errors (ids the model cannot
take: an ``oov`` or a vocabulary beyond its embedding, which would crash on the first unseen
value). The embedding's size comes from the exported program, where an input feeds an
``aten.embedding`` directly (through reshapes at most), else from ``num_embeddings``.
``save_bundle``, ``bundle check``, ``plan`` and ``run`` all use it.
"""

from __future__ import annotations

import operator
import re
from dataclasses import dataclass, field
from typing import Any

import torch

from pipeline.core.errors import ModelError
from pipeline.model.columns import id_limit
from pipeline.model.inputs import InputSpec
from pipeline.model.program import LoadedModel, forward

#: A vocabulary value that stands for "unseen" rather than for a real category: a special
#: token (``<unk>``, ``[UNK]``, ``__unknown__``) or one of a few words that say so.
_RESERVED = re.compile(
    r"^(<[^<>]*>|\[[^\[\]]*\]|__\w*__|unk|unknown|oov|unseen|other|others)$", re.IGNORECASE
)

# Operations an id tensor may pass through on its way to the embedding without its values
# changing: the embedding it reaches is still indexed by the ids the run feeds.
_SAME_VALUES = frozenset(
    {
        "aten.view.default",
        "aten.reshape.default",
        "aten._unsafe_view.default",
        "aten.unsqueeze.default",
        "aten.squeeze.dim",
        "aten.squeeze.dims",
        "aten.squeeze.default",
        "aten.flatten.using_ints",
        "aten.clone.default",
        "aten.contiguous.default",
        "aten.alias.default",
        "aten._to_copy.default",
        "aten.to.dtype",
        "aten.to.dtype_layout",
        "aten.expand.default",
    }
)
# Embedding lookups: (weight, indices, ...) for each.
_EMBEDDINGS = frozenset(
    {
        "aten.embedding.default",
        "aten.embedding_bag.default",
        "aten.embedding_bag.padding_idx",
        "aten._embedding_bag.default",
        "aten._embedding_bag_forward_only.default",
    }
)


def is_reserved(value: str) -> bool:
    """Whether ``value`` reads as a placeholder for unseen values (``<unk>``, ``[UNK]``)."""
    return bool(_RESERVED.match(value.strip()))


def embedding_rows(model: LoadedModel) -> dict[int, int]:
    """By declared input position, the rows of the embedding each integer input indexes
    directly in the exported program (the smallest, if it indexes several); inputs whose ids
    are changed first (``brand + 1``), and programs that are not fx graphs (TorchScript), are
    left out: their room is not known."""
    module = model.module
    if not isinstance(module, torch.fx.GraphModule):
        return {}
    placeholders = [n for n in module.graph.nodes if n.op == "placeholder"]
    position = {n: model.order[k] for k, n in enumerate(placeholders) if k < len(model.order)}
    rows: dict[int, int] = {}
    for node in module.graph.nodes:
        if node.op != "call_function" or str(node.target) not in _EMBEDDINGS:
            continue
        weight, ids = node.args[0], node.args[1]
        n = _rows_of(module, weight)
        while isinstance(ids, torch.fx.Node) and ids.op == "call_function":
            if str(ids.target) not in _SAME_VALUES or not ids.args:
                break
            ids = ids.args[0]
        k = position.get(ids) if isinstance(ids, torch.fx.Node) else None
        if n is not None and k is not None:
            rows[k] = min(n, rows.get(k, n))
    return rows


def _rows_of(module: torch.fx.GraphModule, weight: Any) -> int | None:
    if not isinstance(weight, torch.fx.Node) or weight.op != "get_attr":
        return None
    try:
        tensor = operator.attrgetter(str(weight.target))(module)
    except AttributeError:
        return None
    return int(tensor.shape[0]) if isinstance(tensor, torch.Tensor) and tensor.dim() else None


@dataclass
class Findings:
    """What :func:`findings` says about a bundle's vocabulary inputs."""

    warnings: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def findings(model: LoadedModel) -> Findings:
    """Each vocabulary input's ``oov`` against its vocabulary and the model's embedding."""
    rows = embedding_rows(model)
    found = Findings()
    for k, inp in enumerate(model.spec.inputs):
        if inp.vocabulary is None or not inp.vocab:
            continue
        room = rows.get(k, inp.num_embeddings)
        where = f"model bundle {model.spec.uri}: input {inp.name!r} (column {inp.column!r})"
        n = len(inp.vocab)
        if room is not None and n > room:
            found.errors.append(
                f"{where}: its vocabulary {inp.vocabulary} has {n:,} values, but the model's "
                f"embedding for it has {room:,} rows (ids 0..{room - 1}); the ids beyond would "
                "crash the model. Give the embedding a row per value"
            )
        elif room is not None and inp.oov is not None and inp.oov >= room:
            found.errors.append(
                f"{where}: oov = {inp.oov} is beyond the model's embedding for it, {room:,} "
                f"rows (ids 0..{room - 1}): the first unseen value would crash the model. "
                + _safe_form(inp, room)
            )
        elif inp.oov is not None and inp.oov < n and not is_reserved(inp.vocab[inp.oov]):
            value = inp.vocab[inp.oov]
            found.warnings.append(
                f"{where}: oov = {inp.oov} is the id of {value!r} (line {inp.oov + 1} of "
                f"{inp.vocabulary}), a real value: every {inp.column} not in the vocabulary is "
                f"scored exactly as {value!r}. Give unseen values their own id: "
                + _safe_form(inp, room)
            )
    return found


def _safe_form(inp: InputSpec, room: int | None) -> str:
    """The two ways to give unseen values an id of their own, sized to the model's embedding
    (``room`` rows) where it is known."""
    n = len(inp.vocab)
    reserve = (
        'or reserve an entry: put "<unk>" first in the vocabulary (ids shift by one, so train '
        "with it) and set oov = 0"
    )
    if room is not None and room > n:
        return (
            f"the model's embedding has {room:,} rows for {n:,} values, so set oov = {n} "
            f'(in save_bundle: "oov": len(vocabulary)), {reserve}'
        )
    if room is not None:
        return (
            f"the model's embedding has {room:,} rows for {n:,} values, none to spare: give it "
            f"one more (nn.Embedding({n + 1}, ...)), set oov = {n}, {reserve}"
        )
    return (
        f"set oov = {n} if the model's embedding has a row for it (nn.Embedding({n + 1}, "
        f"...) or more), {reserve}"
    )


def check(model: LoadedModel) -> list[str]:
    """Raise :class:`ModelError` for ids the model cannot take; return the warnings, for the
    caller to say where its user looks (a log line, the report, the terminal)."""
    found = findings(model)
    if found.errors:
        raise ModelError("\n".join(found.errors))
    return found.warnings


def check_declared_ranges(model: LoadedModel) -> None:
    """The model on ids up to every limit the bundle declares (a vocabulary's size, an oov or
    fill id, num_embeddings - 1): a vocabulary longer than the model's embedding would fail
    on real rows the example never had. The input that breaks it is named."""
    with torch.inference_mode():
        try:
            forward(model, model.example(64, random=True))
            return
        except Exception as e:
            first = e
        for k, inp in enumerate(model.spec.inputs):
            high = id_limit(inp)
            if high is None:
                continue
            xs = list(model.example(2))
            xs[k] = torch.full_like(xs[k], high - 1)
            try:
                forward(model, tuple(xs))
            except Exception as e:
                raise ModelError(
                    f"model bundle {model.spec.uri}: the model fails on id {high - 1} of input "
                    f"{inp.name!r}, "
                    f"which its bundle declares valid ({_limit_text(inp)}): "
                    f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                ) from e
    raise ModelError(
        f"model bundle {model.spec.uri}: the model fails on random inputs within the declared "
        "ranges: "
        f"{type(first).__name__}: {first}"
    ) from first


def _limit_text(inp: Any) -> str:
    if inp.num_embeddings is not None:
        return f"num_embeddings = {inp.num_embeddings}"
    return f"a vocabulary of {len(inp.vocab)} values" + (f", oov = {inp.oov}" if inp.oov else "")

"""What the router asks a cloud for: which of its models answers each family, and how.

A Stratus cloud gateway lists its models with RepositoryIndex under the families' own
names. A cloud that is someone else's OIP server (Triton, KServe, MLServer) may restrict
that listing (PyTriton does unless given its access token), list nothing (PyTriton loads
models without a repository), not have it (KServe), or name its models as the repository
names its variants (``digits-large``). So the router also asks ModelReady/ModelMetadata
for the names it has reason to expect (each family's own name, and those the operator
names with ``--cloud-models``), and routes a family to a model only when the model's
tensors are the family's. This module holds the pure parts of that: parsing the flags,
resolving a name to its family, checking tensors, and choosing the name a request for a
family is sent under. No I/O here; :mod:`router.cloud.link` asks the questions.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass

from stratus.convert.fleet import tensor_specs
from stratus.errors import ConfigError
from stratus.families.description import FamilyDescription
from stratus.families.generation import TEXT_INPUT, TEXT_OUTPUT
from stratus.families.spec import TensorSpec
from stratus.wire import inference_pb2 as pb

# gRPC metadata keys: lowercase ASCII letters, digits and - _ . ; "grpc-" is gRPC's own.
_HEADER_KEY = re.compile(r"^[0-9a-z_.-]+$")
_MODEL_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")
# Binary headers ("-bin") would need bytes values; the flag takes text.
_RESERVED_PREFIX = "grpc-"
Tensors = Sequence[pb.ModelMetadataResponse.TensorMetadata]


@dataclass(frozen=True, kw_only=True)
class NamedModel:
    """A model the operator says the cloud serves (``--cloud-models``), and for which family
    (None: the family its name starts with, ``digits-large`` -> ``digits``)."""

    name: str
    family: str | None = None


def parse_cloud_models(text: str | None) -> tuple[NamedModel, ...]:
    """``NAME`` or ``FAMILY=NAME``, comma-separated; ValueError naming the bad entry."""
    named: list[NamedModel] = []
    for entry in (part.strip() for part in (text or "").split(",")):
        if not entry:
            continue
        family, _, name = entry.rpartition("=")
        for part in (name, family) if family else (name,):
            if not _MODEL_NAME.match(part):
                raise ValueError(f"--cloud-models entry {entry!r}: {part!r} is not a model name")
        named.append(NamedModel(name=name, family=family or None))
    return tuple(named)


def parse_header(text: str) -> tuple[str, str]:
    """``KEY=VALUE`` as gRPC metadata; ValueError saying what gRPC would refuse, before a
    call fails on it."""
    key, sep, value = text.partition("=")
    key = key.strip().lower()
    if not sep or not key:
        raise ValueError(f"--cloud-header {text!r}: expected KEY=VALUE")
    if not _HEADER_KEY.match(key) or key.startswith(_RESERVED_PREFIX) or key.endswith("-bin"):
        raise ValueError(
            f"--cloud-header {key!r}: a key is lowercase letters, digits, '-', '_' or '.', "
            "not starting with 'grpc-' nor ending with '-bin'"
        )
    if not value.isascii() or not value.isprintable():
        raise ValueError(f"--cloud-header {key!r}: the value must be printable ASCII")
    return key, value


def secret_headers(text: str) -> tuple[tuple[str, str], ...]:
    """``KEY=VALUE`` lines (``--cloud-header-file``; blank lines and ``#`` comments skipped) as
    gRPC metadata. A bad line is refused by its number and key, never echoing a value."""
    headers = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        key, sep, value = line.partition("=")
        try:  # "key = value" as people write files: the spaces around '=' are not the value's
            headers.append(parse_header(f"{key.strip()}{sep}{value.strip()}"))
        except ValueError:
            key = key.strip() if sep else "(no '=')"
            raise ConfigError(
                f"--cloud-header-file line {number} (key {key[:64]!r}): expected KEY=VALUE, a key of "
                "lowercase letters, digits, '-', '_' or '.' (not 'grpc-...' nor '...-bin') and a "
                "printable ASCII value (not shown)"
            ) from None
    return tuple(headers)


def family_of(name: str, families: Collection[str], named: Sequence[NamedModel] = ()) -> str | None:
    """The family a cloud model answers: as ``--cloud-models`` says, the family itself, or
    the longest family whose name and a dash begin it (``digits-large-fp16`` -> ``digits``)."""
    for entry in named:
        if entry.name == name and entry.family is not None:
            return entry.family
    if name in families:
        return name
    prefixes = [f for f in families if name.startswith(f + "-")]
    return max(prefixes, key=len, default=None)


def probe_names(
    families: Mapping[str, FamilyDescription], named: Sequence[NamedModel], listed: Iterable[str]
) -> list[str]:
    """Every name worth asking the cloud about, each once, in a stable order: the families'
    own names, the operator's, the cloud variants the families name (``digits-large``, as
    agents' Hellos describe them), then whatever the cloud listed."""
    expected = [name for family in sorted(families) for name in families[family].cloud_variants]
    names = [*sorted(families), *(entry.name for entry in named), *expected, *sorted(listed)]
    return list(dict.fromkeys(names))


def _shapes_fit(want: Sequence[int], have: Sequence[int]) -> bool:
    return len(want) == len(have) and all(w == h or -1 in (w, h) for w, h in zip(want, have, strict=True))


def _tensors_mismatch(kind: str, want: Sequence[TensorSpec], have: Tensors) -> str | None:
    offered = {t.name: t for t in have}
    for spec in want:
        tensor = offered.get(spec.name)
        if tensor is None:
            return f"no {kind} '{spec.name}' (it has {sorted(offered)})"
        if tensor.datatype != spec.datatype:
            return f"{kind} '{spec.name}' is {tensor.datatype}, the family's is {spec.datatype}"
        if not _shapes_fit(spec.shape, tensor.shape):
            return f"{kind} '{spec.name}' has shape {list(tensor.shape)}, the family's is {list(spec.shape)}"
    return None


def mismatch(family: FamilyDescription, metadata: pb.ModelMetadataResponse) -> str | None:
    """Why a cloud model cannot answer the family's requests (None: its tensors fit).

    A generative family needs Triton's text layout; a classifier needs each of the family's
    inputs and outputs by name, datatype and shape (-1 fits any size)."""
    if family.generative:
        return None if generates(metadata) else f"it does not take '{TEXT_INPUT}' and give '{TEXT_OUTPUT}'"
    return _tensors_mismatch("input", family.inputs, metadata.inputs) or _tensors_mismatch(
        "output", family.outputs, metadata.outputs
    )


def generates(metadata: pb.ModelMetadataResponse) -> bool:
    """A model that takes one prompt and gives text, as Triton's vLLM backend lays it out."""
    inputs = [(t.name, t.datatype) for t in metadata.inputs]
    outputs = [(t.name, t.datatype) for t in metadata.outputs]
    return inputs == [(TEXT_INPUT, "BYTES")] and outputs == [(TEXT_OUTPUT, "BYTES")]


@dataclass(frozen=True, kw_only=True)
class Found:
    """A model the cloud said is ready, with its description (None: it gave none)."""

    name: str
    metadata: pb.ModelMetadataResponse | None


def _fits(found: Found, info: FamilyDescription | None, *, named: bool) -> str | None:
    """Why ``found`` may not answer the family (None: it may). A model that describes no
    tensors is taken only where the operator named it."""
    if info is None:
        return None
    metadata = found.metadata
    if metadata is None or not (metadata.inputs or metadata.outputs):
        return None if named else "it does not describe its tensors (name it with --cloud-models)"
    return mismatch(info, metadata)


def routes(
    found: Sequence[Found], families: Mapping[str, FamilyDescription], named: Sequence[NamedModel]
) -> tuple[dict[str, str], list[str]]:
    """(request name -> the name it is sent under, why some were passed over).

    A ready model that is no family's name serves its own name (a pinned variant). A family
    is sent under the first model that fits it: one the operator named for it, else its own
    name, else one whose name begins with the family's (``found`` is in that order already
    but for the operator's). A family that nothing fits is not the cloud's."""
    wire = {entry.name: entry.name for entry in found if entry.name not in families}
    refused: list[str] = []
    explicit = [entry.name for entry in named]
    by_name = {entry.name: entry for entry in found}
    ordered = [by_name[name] for name in explicit if name in by_name]
    ordered += [entry for entry in found if entry.name not in explicit]
    for family in sorted(families):
        for entry in ordered:
            if family_of(entry.name, families, named) != family:
                continue
            reason = _fits(entry, families[family], named=entry.name in explicit)
            if reason is None:
                wire[family] = entry.name
                break
            refused.append(f"{entry.name} for {family}: {reason}")
    return wire, refused


def answered_by(wire: Mapping[str, str], variants: Mapping[str, str]) -> dict[str, str]:
    """What answers each request name at the cloud, for operators: the variant a Stratus
    gateway's ModelConfig names (``stratus.variant``: ``digits`` -> ``digits-large-fp16``);
    elsewhere the model the name is sent as (Triton's versions are numbers, not variants)."""
    return {name: variants.get(sent_as, sent_as) for name, sent_as in wire.items()}


def descriptions(
    found: Sequence[Found], wire: Mapping[str, str], generative: Mapping[str, FamilyDescription]
) -> dict[str, FamilyDescription]:
    """Each request name the cloud serves, described as the cloud describes the model it is
    sent under (its own tensors, names, datatypes and shapes): what the router says of a
    model only the cloud serves. Models that describe nothing are left out."""
    by_name = {entry.name: entry for entry in found}
    described: dict[str, FamilyDescription] = {}
    for name, wire_name in wire.items():
        entry = by_name.get(wire_name)
        if entry is None or entry.metadata is None or not (entry.metadata.inputs or entry.metadata.outputs):
            continue
        info = generative.get(wire_name)
        if info is None:
            info = FamilyDescription(
                name=name, inputs=tensor_specs(entry.metadata.inputs), outputs=tensor_specs(entry.metadata.outputs)
            )
        described[name] = info
    return described

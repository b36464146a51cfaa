"""SentencePiece ``.model`` files: the ``ModelProto`` protobuf, read and written through the
``sentencepiece`` package's generated module (an optional dependency:
``pip install "llmlab-tokenizer[sentencepiece]"``).

Only what decides the ids is interpreted: the pieces (text, score, type), ``model_type``,
``byte_fallback`` and the normalizer spec. A setting llmlab does not implement is refused with
its name, never ignored.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

# sentencepiece's piece types (sentencepiece_model.proto)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
KINDS = {NORMAL: "normal", UNKNOWN: "unknown", CONTROL: "control", USER_DEFINED: "user_defined",
         UNUSED: "unused", BYTE: "byte"}  # fmt: skip
TYPES = {kind: number for number, kind in KINDS.items()}
MODEL_TYPES = {1: "unigram", 2: "bpe", 3: "word", 4: "char"}


def _pb2() -> Any:
    try:
        from sentencepiece import sentencepiece_model_pb2
    except ImportError as exc:  # sentencepiece absent, or protobuf missing
        raise ImportError(
            "reading or writing a SentencePiece .model needs the sentencepiece and protobuf "
            'packages: pip install "llmlab-tokenizer[sentencepiece]"'
        ) from exc
    return sentencepiece_model_pb2


def read_model(path: Path) -> dict[str, Any]:
    """The fields of a ``.model`` llmlab uses, as plain Python values."""
    proto = _pb2().ModelProto()
    try:
        proto.ParseFromString(path.read_bytes())
    except Exception as exc:  # protobuf's DecodeError
        raise ValueError(f"not a SentencePiece model protobuf: {exc}") from exc
    if not proto.pieces:
        raise ValueError("the model has no pieces")
    trainer, norm = proto.trainer_spec, proto.normalizer_spec
    if trainer.treat_whitespace_as_suffix:
        raise ValueError("treat_whitespace_as_suffix=true is not supported")
    if norm.normalization_rule_tsv:
        raise ValueError(
            "normalization_rule_tsv (rules not compiled into a charsmap) is not supported"
        )
    return {
        "model_type": MODEL_TYPES.get(trainer.model_type, str(trainer.model_type)),
        "pieces": [(p.piece, p.score, KINDS.get(p.type, str(p.type))) for p in proto.pieces],
        "byte_fallback": trainer.byte_fallback,
        "normalizer": {
            "name": norm.name,
            "add_dummy_prefix": norm.add_dummy_prefix,
            "remove_extra_whitespaces": norm.remove_extra_whitespaces,
            "escape_whitespaces": norm.escape_whitespaces,
            "precompiled_charsmap": bytes(norm.precompiled_charsmap),
        },
    }


def write_model(
    pieces: list[tuple[str, float, str]],
    byte_fallback: bool,
    normalizer: dict[str, Any],
) -> bytes:
    """A ``.model`` of a BPE SentencePiece model that ``SentencePieceProcessor`` loads."""
    pb2 = _pb2()
    proto = pb2.ModelProto()
    for piece, score, kind in pieces:
        entry = proto.pieces.add()
        entry.piece, entry.score, entry.type = piece, score, TYPES[kind]
    trainer = proto.trainer_spec
    trainer.model_type = 2  # BPE
    trainer.vocab_size = len(pieces)
    trainer.byte_fallback = byte_fallback
    ids = {kind: i for i, (_, _, kind) in reversed(list(enumerate(pieces)))}
    names = [p for p, _, _ in pieces]
    trainer.unk_id = ids.get("unknown", 0)
    trainer.unk_piece = names[trainer.unk_id]
    controls = [i for i, (_, _, kind) in enumerate(pieces) if kind == "control"]
    for field, piece in (("bos", "<s>"), ("eos", "</s>"), ("pad", "<pad>")):
        found = next((i for i in controls if names[i] == piece), -1)
        setattr(trainer, f"{field}_id", found)
        if found >= 0:
            setattr(trainer, f"{field}_piece", piece)
    spec = proto.normalizer_spec
    spec.name = normalizer.get("name", "identity")
    spec.add_dummy_prefix = normalizer["add_dummy_prefix"]
    spec.remove_extra_whitespaces = normalizer["remove_extra_whitespaces"]
    spec.escape_whitespaces = normalizer["escape_whitespaces"]
    spec.precompiled_charsmap = normalizer.get("precompiled_charsmap", b"")
    return proto.SerializeToString()

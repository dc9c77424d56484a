"""Interop peer for sim's tests: a real libzmq (pyzmq) SUB and DEALER read
the simulator, and msgspec structs declared as each engine declares them
(field order, array_like, omit_defaults, tag) decode every payload and
re-encode it. Equal bytes mean the simulator's output is what the engine's
own msgspec encoder would produce.

usage: msgspec_peer.py ENGINE GEN LIVE_EP REPLAY_EP TOPIC LIVE_COUNT
Prints one JSON object: {"replayed": n, "ended": bool, "live": n,
"mismatches": [...], "errors": [...]}.
"""

import json
import sys
from typing import Optional, Union

import msgspec
import zmq

Hash = Union[int, bytes]


def vllm_structs(gen):
    if gen == "map":
        class Ev(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
            pass

        class BlockStored(Ev):
            block_hashes: list[Hash]
            parent_block_hash: Optional[Hash]
            token_ids: list[int]
            block_size: int
            lora_id: Optional[int]
            medium: Optional[str]
            lora_name: Optional[str]
            extra_keys: Optional[list[Optional[tuple]]] = None
            group_idx: Optional[int] = None
            kv_cache_spec_kind: Optional[str] = None
            kv_cache_spec_sliding_window: Optional[int] = None
            locality: Optional[str] = None
            ownership: Optional[str] = None
            session_id: Optional[str] = None

        class BlockRemoved(Ev):
            block_hashes: list[Hash]
            medium: Optional[str]
            group_idx: Optional[int] = None
            locality: Optional[str] = None
            ownership: Optional[str] = None
    elif gen == "array12":
        class Ev(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
            pass

        class BlockStored(Ev):
            block_hashes: list[Hash]
            parent_block_hash: Optional[Hash]
            token_ids: list[int]
            block_size: int
            lora_id: Optional[int]
            medium: Optional[str]
            lora_name: Optional[str]
            extra_keys: Optional[list[Optional[tuple]]] = None
            group_idx: Optional[int] = None
            kv_cache_spec_kind: Optional[str] = None
            kv_cache_spec_sliding_window: Optional[int] = None

        class BlockRemoved(Ev):
            block_hashes: list[Hash]
            medium: Optional[str]
            group_idx: Optional[int] = None
    else:  # array6, PR #16750
        class Ev(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
            pass

        class BlockStored(Ev):
            block_hashes: list[int]
            parent_block_hash: Optional[int]
            token_ids: list[int]
            block_size: int
            lora_id: Optional[int]

        class BlockRemoved(Ev):
            block_hashes: list[int]

    class AllBlocksCleared(Ev):
        pass

    return BlockStored, BlockRemoved, AllBlocksCleared, gen != "array6"


def sglang_structs(gen):
    array_like = gen != "map"

    class Ev(msgspec.Struct, array_like=array_like, omit_defaults=True, gc=False, tag=True):
        pass

    if gen == "map":
        class BlockStored(Ev):
            block_hashes: list[int]
            parent_block_hash: Optional[int]
            token_ids: list[int]
            block_size: int
            lora_id: Optional[int]
            medium: Optional[str] = None
            cache_salt: Optional[str] = None
            session_id: Optional[str] = None

        class BlockRemoved(Ev):
            block_hashes: list[int]
            medium: Optional[str] = None
    elif gen == "array7":
        class BlockStored(Ev):
            block_hashes: list[int]
            parent_block_hash: Optional[int]
            token_ids: list[int]
            block_size: int
            lora_id: Optional[int]
            medium: Optional[str] = None

        class BlockRemoved(Ev):
            block_hashes: list[int]
            medium: Optional[str] = None
    else:  # array6, the oldest
        class BlockStored(Ev):
            block_hashes: list[int]
            parent_block_hash: Optional[int]
            token_ids: list[int]
            block_size: int
            lora_id: Optional[int]

        class BlockRemoved(Ev):
            block_hashes: list[int]

    class AllBlocksCleared(Ev):
        pass

    return BlockStored, BlockRemoved, AllBlocksCleared, gen != "array6"


def tokenspeed_structs(gen):
    class Ev(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
        pass

    class BlockStored(Ev):
        block_hashes: list[int]
        parent_block_hash: Optional[int]
        token_ids: list[int]
        block_size: int

    class BlockRemoved(Ev):
        block_hashes: list[int]

    class AllBlocksCleared(Ev):
        pass

    return BlockStored, BlockRemoved, AllBlocksCleared, True


def batch_type(engine, gen):
    stored, removed, cleared, has_rank = {
        "vllm": vllm_structs, "sglang": sglang_structs, "tokenspeed": tokenspeed_structs,
    }[engine](gen)
    Events = list[Union[stored, removed, cleared]]
    if has_rank:
        class Batch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
            ts: float
            events: Events
            rank: Optional[int] = None
    else:
        class Batch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
            ts: float
            events: Events
    return Batch


def main():
    engine, gen, live_ep, replay_ep, topic, live_count = sys.argv[1:7]
    live_count = int(live_count)
    topic_frame = engine == "vllm"
    dec = msgspec.msgpack.Decoder(batch_type(engine, gen))
    enc = msgspec.msgpack.Encoder()
    out = {"replayed": 0, "ended": False, "live": 0, "mismatches": [], "errors": []}

    def check(where, payload):
        try:
            again = enc.encode(dec.decode(payload))
        except Exception as e:  # noqa: BLE001 - reported to the Go test
            out["errors"].append(f"{where}: {e}")
            return
        if again != payload:
            out["mismatches"].append({"where": where, "sim": payload.hex(), "msgspec": again.hex()})

    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.connect(live_ep)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(replay_ep)
    dealer.send_multipart([b"", (0).to_bytes(8, "big")])
    want = 4 if topic_frame else 3
    while dealer.poll(5000):
        frames = dealer.recv_multipart()
        if len(frames) != want or frames[0] != b"":
            out["errors"].append(f"replay reply frames {len(frames)}")
            break
        seq, payload = frames[-2], frames[-1]
        if seq == b"\xff" * 8:
            out["ended"] = payload == b"" and (not topic_frame or frames[1] == b"")
            break
        if topic_frame and frames[1] != topic.encode():
            out["errors"].append(f"replay topic {frames[1]!r}")
        if int.from_bytes(seq, "big") != out["replayed"]:
            out["errors"].append(f"replay seq {int.from_bytes(seq, 'big')} at {out['replayed']}")
        check(f"replay seq {int.from_bytes(seq, 'big')}", payload)
        out["replayed"] += 1
    last = None
    while out["live"] < live_count and sub.poll(10000):
        frames = sub.recv_multipart()
        if len(frames) != 3 or frames[0] != topic.encode() or len(frames[1]) != 8:
            out["errors"].append(f"live frames {frames[:2]!r}")
            break
        seq = int.from_bytes(frames[1], "big")
        if last is not None and seq != last + 1:
            out["errors"].append(f"live seq {seq} after {last}")
        last = seq
        check(f"live seq {seq}", frames[2])
        out["live"] += 1
    print(json.dumps(out), flush=True)
    sub.close(0)
    dealer.close(0)
    ctx.term()


main()

"""SMG's Python KV-event relay behind a gRPC server: the peer kvrelay is
compared with (differential tests) and measured against (benchmarks).

The real servicer needs a running engine; this script serves exactly the
relay function that servicer calls, `smg_grpc_servicer.kv_relay.relay`, as
SubscribeKvEvents under the engine's service name, and nothing else.

Usage: py_relay_server.py --engine vllm|sglang|tokenspeed --endpoint tcp://127.0.0.1:P
       [--replay-endpoint tcp://127.0.0.1:R] [--dp-size N] [--topic T] [--port 0]
       [--load-file PATH]
--load-file installs a scripted load source, as a servicer installs its GetLoads
figures: the file holds {"RANK": {EngineLoad fields}}, reread on every call, so
a test changes the engine's load by replacing the file.
Prints {"ready": true, "port": N} on stdout once it listens.
"""

import json

from smg_grpc_proto.generated import (
    sglang_scheduler_pb2_grpc,
    tokenspeed_scheduler_pb2_grpc,
    vllm_engine_pb2_grpc,
)
from smg_grpc_servicer import kv_relay

import relay_peer

SERVICES = {
    "vllm": (vllm_engine_pb2_grpc.VllmEngineServicer, vllm_engine_pb2_grpc.add_VllmEngineServicer_to_server, kv_relay.Engine.VLLM),
    "sglang": (sglang_scheduler_pb2_grpc.SglangSchedulerServicer, sglang_scheduler_pb2_grpc.add_SglangSchedulerServicer_to_server, kv_relay.Engine.SGLANG),
    "tokenspeed": (tokenspeed_scheduler_pb2_grpc.TokenSpeedSchedulerServicer, tokenspeed_scheduler_pb2_grpc.add_TokenSpeedSchedulerServicer_to_server, kv_relay.Engine.TOKENSPEED),
}


async def main() -> int:
    ap = relay_peer.parser()
    ap.add_argument("--engine", choices=sorted(SERVICES), required=True)
    ap.add_argument("--topic", default="")
    ap.add_argument("--load-file", default=None)
    a = ap.parse_args()

    base, add, engine = SERVICES[a.engine]
    sources = relay_peer.rank_sources(a)

    load_source = None
    if a.load_file:
        from smg_grpc_proto.generated import common_pb2

        def load_source(rank):
            try:
                with open(a.load_file) as f:
                    fields = json.load(f).get(str(rank or 0))
            except (OSError, ValueError):
                return None
            return None if fields is None else common_pb2.EngineLoad(**fields)

    class Relay(base):
        async def SubscribeKvEvents(self, request, context):
            async for batch in kv_relay.relay(
                sources, engine, request.start_sequence_number, context, topic=a.topic,
                load_source=load_source,
            ):
                yield batch

    return await relay_peer.serve(add, Relay(), a.port)


if __name__ == "__main__":
    relay_peer.run(main)

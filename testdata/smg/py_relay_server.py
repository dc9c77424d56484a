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

import argparse
import asyncio
import json
import logging
import sys

import grpc
from smg_grpc_proto.generated import (
    sglang_scheduler_pb2_grpc,
    tokenspeed_scheduler_pb2_grpc,
    vllm_engine_pb2_grpc,
)
from smg_grpc_servicer import kv_relay

SERVICES = {
    "vllm": (vllm_engine_pb2_grpc.VllmEngineServicer, vllm_engine_pb2_grpc.add_VllmEngineServicer_to_server, kv_relay.Engine.VLLM),
    "sglang": (sglang_scheduler_pb2_grpc.SglangSchedulerServicer, sglang_scheduler_pb2_grpc.add_SglangSchedulerServicer_to_server, kv_relay.Engine.SGLANG),
    "tokenspeed": (tokenspeed_scheduler_pb2_grpc.TokenSpeedSchedulerServicer, tokenspeed_scheduler_pb2_grpc.add_TokenSpeedSchedulerServicer_to_server, kv_relay.Engine.TOKENSPEED),
}


async def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--engine", choices=sorted(SERVICES), required=True)
    ap.add_argument("--endpoint", required=True)
    ap.add_argument("--replay-endpoint", default=None)
    ap.add_argument("--dp-size", type=int, default=1)
    ap.add_argument("--topic", default="")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--load-file", default=None)
    a = ap.parse_args()
    # The relay logs its subscriptions, replays and failures at INFO/WARNING;
    # tests read them on stderr when something goes wrong.
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    base, add, engine = SERVICES[a.engine]
    config = argparse.Namespace(endpoint=a.endpoint, replay_endpoint=a.replay_endpoint)
    sources = kv_relay.rank_sources(config, range(a.dp_size))

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

    server = grpc.aio.server()
    add(Relay(), server)
    port = server.add_insecure_port(f"127.0.0.1:{a.port}")
    await server.start()
    print(json.dumps({"ready": True, "port": port}), flush=True)
    await server.wait_for_termination()
    return 0


if __name__ == "__main__":
    try:
        sys.exit(asyncio.run(main()))
    except KeyboardInterrupt:
        pass

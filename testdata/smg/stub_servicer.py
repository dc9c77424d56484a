"""A stub vLLM engine servicer for interop tests with SMG's real gateway.

It answers the calls SMG's gateway makes to register and poll a gRPC worker
(GetModelInfo, GetServerInfo, HealthCheck, GetLoads, GetTokenizer) with fixed,
plausible values, and logs every call it receives as a JSON line on stdout, so
a test can see what the gateway asked for. It never serves
SubscribeKvEvents itself unless --events is given: in the interop test that
RPC is answered by kvrelay in front of this stub.

With --loads JSON ({"<rank>": {SchedulerLoad fields}}), GetLoads reports
those ranks' loads; without it, an empty report.

Usage: stub_servicer.py --port N [--model NAME] [--events] [--loads JSON]
"""

import argparse
import json
import sys
import threading
import time
from concurrent import futures

import grpc
from smg_grpc_proto.generated import common_pb2, vllm_engine_pb2 as pb, vllm_engine_pb2_grpc as pbg


_log_lock = threading.Lock()


def log(**kw):
    # One write per line under a lock: the server's threads log concurrently.
    line = json.dumps(kw) + "\n"
    with _log_lock:
        sys.stdout.write(line)
        sys.stdout.flush()


class Stub(pbg.VllmEngineServicer):
    def __init__(self, model, events, loads=None):
        self.model = model
        self.events = events
        self.loads = [pb.SchedulerLoad(dp_rank=int(rank), **fields) for rank, fields in (loads or {}).items()]

    def GetModelInfo(self, request, context):
        log(call="GetModelInfo")
        return pb.GetModelInfoResponse(
            model_path=self.model, is_generation=True, max_context_length=32768,
            vocab_size=32000, served_model_name=self.model, tokenizer_path=self.model,
            model_type="llama", architectures=["LlamaForCausalLM"], eos_token_ids=[2],
            pad_token_id=0, bos_token_id=1, max_req_input_len=32000)

    def GetServerInfo(self, request, context):
        log(call="GetServerInfo")
        return pb.GetServerInfoResponse()

    def HealthCheck(self, request, context):
        log(call="HealthCheck")
        return pb.HealthCheckResponse(healthy=True, message="ok")

    def GetLoads(self, request, context):
        log(call="GetLoads")
        return pb.GetLoadsResponse(dp_rank_count=len(self.loads), loads=self.loads)

    def SubscribeKvEvents(self, request, context):
        log(call="SubscribeKvEvents", start=request.start_sequence_number)
        if not self.events:
            context.abort(grpc.StatusCode.UNIMPLEMENTED, "stub: events are served by kvrelay")
        blocks = [common_pb2.KvBlock(block_hash=1000 + i, token_ids=list(range(i * 16, i * 16 + 16)), block_size=16) for i in range(4)]
        yield common_pb2.KvEventBatch(sequence_number=1, timestamp=time.time(), dp_rank=0, events=[
            common_pb2.KvCacheEvent(event_id=1, stored=common_pb2.KvBlocksStored(blocks=blocks))])
        while context.is_active():
            time.sleep(0.2)


class Logger(grpc.ServerInterceptor):
    def intercept_service(self, continuation, details):
        log(method=details.method)
        return continuation(details)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--model", default="stub-model")
    ap.add_argument("--events", action="store_true")
    ap.add_argument("--loads", default=None)
    a = ap.parse_args()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=16), interceptors=[Logger()])
    pbg.add_VllmEngineServicer_to_server(Stub(a.model, a.events, json.loads(a.loads) if a.loads else None), server)
    port = server.add_insecure_port(f"127.0.0.1:{a.port}")
    server.start()
    log(ready=True, port=port)
    try:
        server.wait_for_termination()
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    sys.exit(main())

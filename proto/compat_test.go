// Package kvpb_test proves kvpb is wire-compatible with SMG's own generated
// proto (the smg-grpc-proto Python package gateways and servicers use):
// messages cross in both directions with every field intact, and the
// descriptors (field numbers, types, presence, services) are the same.
package kvpb_test

import (
	"bytes"
	"encoding/hex"
	"encoding/json"
	"math"
	"sort"
	"testing"

	"github.com/google/go-cmp/cmp"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protodesc"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/reflect/protoregistry"
	"google.golang.org/protobuf/testing/protocmp"
	"google.golang.org/protobuf/types/descriptorpb"

	"github.com/kvrelay/kvrelay/proto/kvpb"
	"github.com/kvrelay/kvrelay/testkit/pyenv"
)

// rankCursors is kvrelay's extension to SubscribeKvEventsRequest (field 16);
// SMG does not declare it and must carry it as an unknown field.
const rankCursors protoreflect.FullName = "smg.grpc.common.SubscribeKvEventsRequest.rank_cursors"

// liveDigest and liveBlocks are kvrelay's anti-entropy extension to
// KvEventBatch (fields 16 and 17), unknown to SMG as well.
const (
	liveDigest protoreflect.FullName = "smg.grpc.common.KvEventBatch.live_digest"
	liveBlocks protoreflect.FullName = "smg.grpc.common.KvEventBatch.live_blocks"
	// liveDigests is the request's switch for them (field 17).
	liveDigests protoreflect.FullName = "smg.grpc.common.SubscribeKvEventsRequest.live_digests"
)

func runPeer(t *testing.T, stdin []byte, mode string) []byte {
	t.Helper()
	cmd := pyenv.Command(t, pyenv.Script("protocompat", "roundtrip.py"), mode)
	cmd.Stdin = bytes.NewReader(stdin)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("roundtrip.py %s: %v\n%s", mode, err, stderr.String())
	}
	return out
}

// goSamples are the messages roundtrip.py builds, written out independently
// here: every field of every KV message is set somewhere, with boundary
// values and explicit-presence zeros.
func goSamples() map[string]proto.Message {
	stored := &kvpb.KvBlocksStored{
		Blocks: []*kvpb.KvBlock{
			{
				BlockHash:  math.MinInt64,
				TokenIds:   []uint32{0, math.MaxUint32, 7},
				BlockSize:  3,
				LoraId:     proto.Int64(-1),
				CacheLevel: proto.Int32(0),
				ExtraKeys: []*kvpb.KvBlockExtraKey{
					{Key: &kvpb.KvBlockExtraKey_Text{Text: "tenant-a"}},
					{Key: &kvpb.KvBlockExtraKey_Blob{Blob: []byte{0x00, 0xff}}},
					{Key: &kvpb.KvBlockExtraKey_Number{Number: math.MinInt64}},
					{Key: &kvpb.KvBlockExtraKey_Multimodal{Multimodal: &kvpb.KvMultimodalKey{Identifier: "img0", Offset: math.MaxInt64}}},
				},
			},
			{BlockHash: math.MaxInt64, TokenIds: []uint32{1, 2, 3}, BlockSize: 3},
		},
		ParentBlockHash:          proto.Int64(0),
		Tier:                     kvpb.KvCacheTier_KV_CACHE_TIER_HOST.Enum(),
		Medium:                   proto.String("CPU"),
		GroupIdx:                 proto.Uint32(math.MaxUint32),
		KvCacheSpecKind:          proto.String("sliding_window"),
		KvCacheSpecSlidingWindow: proto.Uint32(0),
		Locality:                 kvpb.KvCacheLocality_KV_CACHE_LOCALITY_REMOTE.Enum(),
		Ownership:                proto.String("lmcache"),
		SessionId:                proto.String("sess-\u00fc"),
		LoraName:                 proto.String("adapter"),
		CacheSalt:                proto.String("salt"),
	}
	removed := &kvpb.KvBlocksRemoved{
		BlockHashes: []int64{-1, 0, 1},
		CacheLevel:  proto.Int32(3),
		Tier:        kvpb.KvCacheTier_KV_CACHE_TIER_EXTERNAL.Enum(),
		Medium:      proto.String("SHARED"),
		GroupIdx:    proto.Uint32(0),
		Locality:    kvpb.KvCacheLocality_KV_CACHE_LOCALITY_LOCAL.Enum(),
		Ownership:   proto.String("o"),
	}
	return map[string]proto.Message{
		"batch_events": &kvpb.KvEventBatch{
			SequenceNumber: math.MaxUint64,
			Timestamp:      1700000000.5,
			DpRank:         proto.Int32(0),
			Events: []*kvpb.KvCacheEvent{
				{EventId: 1, Data: &kvpb.KvCacheEvent_Stored{Stored: stored}},
				{EventId: 2, Data: &kvpb.KvCacheEvent_Removed{Removed: removed}},
				{EventId: math.MaxUint64, Data: &kvpb.KvCacheEvent_Cleared{Cleared: &kvpb.KvCacheCleared{Ownership: proto.String("kvcr")}}},
				{EventId: 4, Data: &kvpb.KvCacheEvent_Cleared{Cleared: &kvpb.KvCacheCleared{}}},
			},
		},
		"batch_snapshot": &kvpb.KvEventBatch{
			SequenceNumber: 42,
			Timestamp:      0.25,
			DpRank:         proto.Int32(math.MaxInt32),
			Snapshot:       &kvpb.KvSnapshotChunk{Index: 3, Count: math.MaxUint32, Blocks: math.MaxUint64, UnknownBefore: 1},
			Events:         []*kvpb.KvCacheEvent{{Data: &kvpb.KvCacheEvent_Cleared{Cleared: &kvpb.KvCacheCleared{}}}},
		},
		"batch_load": &kvpb.KvEventBatch{
			SequenceNumber: 43,
			Timestamp:      -1.5,
			DpRank:         proto.Int32(-1),
			Load: &kvpb.EngineLoad{
				RunningRequests:       math.MaxUint32,
				WaitingRequests:       1,
				WaitingUncachedTokens: proto.Uint32(0),
				TokenUsage:            0.75,
				ActiveTokenUsage:      proto.Float64(0),
				GenThroughput:         1234.5,
				MaxRunningRequests:    256,
				AgeMs:                 7,
				Sample:                math.MaxUint64,
				LoadOnly:              true,
				CacheHitRate:          proto.Float64(0.5),
				NumUsedTokens:         proto.Int32(-3),
				MaxTotalNumTokens:     proto.Int32(math.MaxInt32),
				Memory:                &kvpb.EngineMemory{WeightGb: 1.5, KvCacheGb: 2.5, GraphGb: 3.5, TokenCapacity: math.MinInt32},
				Queues:                &kvpb.EngineQueues{Waiting: 1, Grammar: 2, Paused: 3, Retracted: 4},
				Speculative:           &kvpb.EngineSpeculative{AcceptLength: 2.25, AcceptRate: 0.875},
				Lora:                  &kvpb.EngineLora{SlotsUsed: 1, SlotsTotal: 8, Utilization: 0.125},
				Disaggregation: &kvpb.EngineDisaggregation{
					Mode:                     "prefill",
					PrefillPreallocQueueReqs: 1,
					PrefillInflightQueueReqs: 2,
					DecodePreallocQueueReqs:  3,
					DecodeTransferQueueReqs:  4,
					DecodeRetractedQueueReqs: 5,
					KvTransferSpeedGbS:       10.5,
					KvTransferLatencyMs:      0.75,
				},
				EngineSilenceMs:      proto.Uint32(1500),
				EngineReportsSteps:   proto.Bool(false),
				PrefillPendingTokens: proto.Uint32(math.MaxUint32),
			},
		},
		"request": &kvpb.SubscribeKvEventsRequest{
			StartSequenceNumber:         math.MaxUint64,
			LoadRecordsBeforeFirstBatch: true,
		},
		"request_empty": &kvpb.SubscribeKvEventsRequest{},
	}
}

type peerItem struct {
	Type string `json:"type"`
	Hex  string `json:"hex"`
}

type peerDecoded struct {
	JSON          json.RawMessage `json:"json"`
	Hex           string          `json:"hex"`
	UnknownFields []int           `json:"unknown_fields"`
}

func typeName(m proto.Message) string { return string(m.ProtoReflect().Descriptor().Name()) }

// coverage records every field set anywhere in m, so the test can prove the
// samples leave no field of a KV message untested.
func coverage(seen map[protoreflect.FullName]bool, m protoreflect.Message) {
	m.Range(func(fd protoreflect.FieldDescriptor, v protoreflect.Value) bool {
		seen[fd.FullName()] = true
		switch {
		case fd.IsList() && fd.Message() != nil:
			for i := 0; i < v.List().Len(); i++ {
				coverage(seen, v.List().Get(i).Message())
			}
		case fd.IsMap():
		case fd.Message() != nil:
			coverage(seen, v.Message())
		}
		return true
	})
}

// noUnknown fails if any message in the tree carries fields kvpb does not
// declare.
func noUnknown(t *testing.T, where string, m protoreflect.Message) {
	t.Helper()
	if len(m.GetUnknown()) != 0 {
		t.Errorf("%s: %s carries unknown fields %x", where, m.Descriptor().FullName(), m.GetUnknown())
	}
	m.Range(func(fd protoreflect.FieldDescriptor, v protoreflect.Value) bool {
		switch {
		case fd.IsList() && fd.Message() != nil:
			for i := 0; i < v.List().Len(); i++ {
				noUnknown(t, where, v.List().Get(i).Message())
			}
		case fd.IsMap():
		case fd.Message() != nil:
			noUnknown(t, where, v.Message())
		}
		return true
	})
}

func TestPythonEncodedMessagesDecodeInGo(t *testing.T) {
	var fromPython map[string]peerItem
	if err := json.Unmarshal(runPeer(t, nil, "samples"), &fromPython); err != nil {
		t.Fatal(err)
	}
	want := goSamples()
	if len(fromPython) != len(want) {
		t.Fatalf("python sent %d samples, want %d", len(fromPython), len(want))
	}
	seen := map[protoreflect.FullName]bool{}
	for name, item := range fromPython {
		w, ok := want[name]
		if !ok {
			t.Fatalf("python sample %q has no Go counterpart", name)
		}
		if item.Type != typeName(w) {
			t.Fatalf("%s: python type %s, Go %s", name, item.Type, typeName(w))
		}
		raw, err := hex.DecodeString(item.Hex)
		if err != nil {
			t.Fatal(err)
		}
		got := w.ProtoReflect().New().Interface()
		if err := proto.Unmarshal(raw, got); err != nil {
			t.Fatalf("%s: kvpb cannot decode python's bytes: %v", name, err)
		}
		if diff := cmp.Diff(w, got, protocmp.Transform()); diff != "" {
			t.Errorf("%s: decoded from python (-want +got):\n%s", name, diff)
		}
		noUnknown(t, name, got.ProtoReflect())
		coverage(seen, got.ProtoReflect())
	}
	// Every field of every message the stream uses was exercised, except
	// kvrelay's own extension, which SMG cannot send.
	msgs := kvpb.File_smg_common_proto.Messages()
	for i := 0; i < msgs.Len(); i++ {
		md := msgs.Get(i)
		for j := 0; j < md.Fields().Len(); j++ {
			fd := md.Fields().Get(j)
			if fd.FullName() == rankCursors || fd.FullName() == liveDigest || fd.FullName() == liveBlocks || fd.FullName() == liveDigests {
				continue
			}
			if !seen[fd.FullName()] {
				t.Errorf("no sample sets %s: the round trip would not notice it breaking", fd.FullName())
			}
		}
	}
}

func TestGoEncodedMessagesDecodeInPython(t *testing.T) {
	samples := goSamples()
	withCursors := &kvpb.SubscribeKvEventsRequest{
		StartSequenceNumber:         5,
		LoadRecordsBeforeFirstBatch: true,
		RankCursors:                 map[int32]uint64{0: 5, 1: 9, 7: math.MaxUint64},
		LiveDigests:                 true,
	}
	samples["request_rank_cursors"] = withCursors
	samples["batch_live_digest"] = &kvpb.KvEventBatch{
		SequenceNumber: 7, DpRank: proto.Int32(1),
		LiveDigest: proto.Uint64(0xfedcba9876543210), LiveBlocks: proto.Uint64(42),
	}

	request := map[string]peerItem{}
	for name, m := range samples {
		raw, err := proto.MarshalOptions{Deterministic: true}.Marshal(m)
		if err != nil {
			t.Fatal(err)
		}
		request[name] = peerItem{Type: typeName(m), Hex: hex.EncodeToString(raw)}
	}
	in, err := json.Marshal(request)
	if err != nil {
		t.Fatal(err)
	}
	var decoded map[string]peerDecoded
	if err := json.Unmarshal(runPeer(t, in, "decode"), &decoded); err != nil {
		t.Fatal(err)
	}
	if len(decoded) != len(samples) {
		t.Fatalf("python decoded %d messages, want %d", len(decoded), len(samples))
	}
	for name, original := range samples {
		d, ok := decoded[name]
		if !ok {
			t.Fatalf("python did not answer for %s", name)
		}
		// What Python understood, by field name (json_format), must be our
		// message, except the extension it does not declare.
		understood := proto.Clone(original)
		wantUnknown := []int{}
		switch name {
		case "request_rank_cursors":
			understood.(*kvpb.SubscribeKvEventsRequest).RankCursors = nil
			understood.(*kvpb.SubscribeKvEventsRequest).LiveDigests = false
			wantUnknown = []int{16, 17}
		case "batch_live_digest":
			b := understood.(*kvpb.KvEventBatch)
			b.LiveDigest, b.LiveBlocks = nil, nil
			wantUnknown = []int{16, 17}
		}
		fromJSON := original.ProtoReflect().New().Interface()
		if err := protojson.Unmarshal(d.JSON, fromJSON); err != nil {
			t.Fatalf("%s: python's json_format output does not parse: %v\n%s", name, err, d.JSON)
		}
		if diff := cmp.Diff(understood, fromJSON, protocmp.Transform()); diff != "" {
			t.Errorf("%s: as python decoded it (-want +got):\n%s", name, diff)
		}
		sort.Ints(d.UnknownFields)
		if diff := cmp.Diff(wantUnknown, d.UnknownFields); diff != "" {
			t.Errorf("%s: fields python does not know (-want +got):\n%s", name, diff)
		}
		// Python re-encodes unknown fields verbatim, so the extension
		// survives a Python hop and the rest is unchanged.
		raw, err := hex.DecodeString(d.Hex)
		if err != nil {
			t.Fatal(err)
		}
		again := original.ProtoReflect().New().Interface()
		if err := proto.Unmarshal(raw, again); err != nil {
			t.Fatalf("%s: python's re-encoding does not decode: %v", name, err)
		}
		if diff := cmp.Diff(original, again, protocmp.Transform()); diff != "" {
			t.Errorf("%s: after a python round trip (-want +got):\n%s", name, diff)
		}
	}
}

func pythonDescriptors(t *testing.T) map[string]*descriptorpb.FileDescriptorProto {
	t.Helper()
	var files map[string]json.RawMessage
	if err := json.Unmarshal(runPeer(t, nil, "descriptors"), &files); err != nil {
		t.Fatal(err)
	}
	out := map[string]*descriptorpb.FileDescriptorProto{}
	for name, raw := range files {
		fdp := &descriptorpb.FileDescriptorProto{}
		if err := protojson.Unmarshal(raw, fdp); err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		out[name] = fdp
	}
	return out
}

// TestDescriptorsMatchPython compares kvpb's common.proto with SMG's, field by
// field: numbers, names, JSON names, kinds, cardinality, presence, oneofs,
// message and enum types, reserved ranges, enum values. Equal descriptors
// mean equal wire formats for every message, not just the samples.
func TestDescriptorsMatchPython(t *testing.T) {
	pyFDP := pythonDescriptors(t)["common.proto"]
	if pyFDP == nil {
		t.Fatal("python sent no common.proto")
	}
	py, err := protodesc.NewFile(pyFDP, new(protoregistry.Files))
	if err != nil {
		t.Fatalf("building python's common.proto: %v", err)
	}
	ours := kvpb.File_smg_common_proto
	if py.Package() != ours.Package() {
		t.Fatalf("package %s, python %s", ours.Package(), py.Package())
	}
	for i := 0; i < ours.Messages().Len(); i++ {
		md := ours.Messages().Get(i)
		pmd := py.Messages().ByName(md.Name())
		if pmd == nil {
			t.Errorf("python has no message %s", md.FullName())
			continue
		}
		compareMessages(t, md, pmd)
	}
	// Every KV message SMG declares is ours too (a new one would otherwise
	// go unnoticed).
	for i := 0; i < py.Messages().Len(); i++ {
		pmd := py.Messages().Get(i)
		if isStreamMessage(pmd.Name()) && ours.Messages().ByName(pmd.Name()) == nil {
			t.Errorf("python declares %s, kvpb does not", pmd.FullName())
		}
	}
	for i := 0; i < ours.Enums().Len(); i++ {
		ed := ours.Enums().Get(i)
		ped := py.Enums().ByName(ed.Name())
		if ped == nil {
			t.Errorf("python has no enum %s", ed.FullName())
			continue
		}
		if got, want := enumValues(ed), enumValues(ped); !cmp.Equal(got, want) {
			t.Errorf("enum %s: values %v, python %v", ed.FullName(), got, want)
		}
	}
}

func isStreamMessage(name protoreflect.Name) bool {
	switch {
	case name == "SubscribeKvEventsRequest", len(name) > 2 && name[:2] == "Kv", len(name) > 6 && name[:6] == "Engine":
		return true
	}
	return false
}

func enumValues(ed protoreflect.EnumDescriptor) map[protoreflect.Name]protoreflect.EnumNumber {
	out := map[protoreflect.Name]protoreflect.EnumNumber{}
	for i := 0; i < ed.Values().Len(); i++ {
		v := ed.Values().Get(i)
		out[v.Name()] = v.Number()
	}
	return out
}

type fieldShape struct {
	Name, JSONName            string
	Kind                      string
	Cardinality               string
	HasPresence, Optional     bool
	IsMap                     bool
	Oneof, MessageType, Enum  string
	Packed                    bool
	DefaultValueSetExplicitly bool
}

func shapeOf(fd protoreflect.FieldDescriptor) fieldShape {
	s := fieldShape{
		Name:        string(fd.Name()),
		JSONName:    fd.JSONName(),
		Kind:        fd.Kind().String(),
		Cardinality: fd.Cardinality().String(),
		HasPresence: fd.HasPresence(),
		Optional:    fd.HasOptionalKeyword(),
		IsMap:       fd.IsMap(),
		Packed:      fd.IsPacked(),
	}
	if o := fd.ContainingOneof(); o != nil {
		s.Oneof = string(o.Name())
	}
	if m := fd.Message(); m != nil {
		s.MessageType = string(m.FullName())
	}
	if e := fd.Enum(); e != nil {
		s.Enum = string(e.FullName())
	}
	s.DefaultValueSetExplicitly = fd.HasDefault()
	return s
}

func compareMessages(t *testing.T, ours, py protoreflect.MessageDescriptor) {
	t.Helper()
	for i := 0; i < ours.Fields().Len(); i++ {
		fd := ours.Fields().Get(i)
		pfd := py.Fields().ByNumber(fd.Number())
		if fd.FullName() == rankCursors || fd.FullName() == liveDigest || fd.FullName() == liveBlocks || fd.FullName() == liveDigests {
			// An extension must not collide with anything SMG declares.
			if pfd != nil || py.Fields().ByName(fd.Name()) != nil {
				t.Errorf("%s collides with python's field %v", fd.FullName(), pfd)
			}
			continue
		}
		if pfd == nil {
			t.Errorf("%s (%d): python has no field %d", fd.FullName(), fd.Number(), fd.Number())
			continue
		}
		if diff := cmp.Diff(shapeOf(pfd), shapeOf(fd)); diff != "" {
			t.Errorf("%s (%d) differs from python (-python +ours):\n%s", fd.FullName(), fd.Number(), diff)
		}
	}
	for i := 0; i < py.Fields().Len(); i++ {
		pfd := py.Fields().Get(i)
		if ours.Fields().ByNumber(pfd.Number()) == nil {
			t.Errorf("%s (%d): kvpb has no field %d", pfd.FullName(), pfd.Number(), pfd.Number())
		}
	}
	if got, want := reservedRanges(ours), reservedRanges(py); !cmp.Equal(got, want) {
		t.Errorf("%s reserves %v, python %v", ours.FullName(), got, want)
	}
	if got, want := reservedNames(ours), reservedNames(py); !cmp.Equal(got, want) {
		t.Errorf("%s reserves names %v, python %v", ours.FullName(), got, want)
	}
	for i := 0; i < ours.Messages().Len(); i++ {
		nested := ours.Messages().Get(i)
		if nested.IsMapEntry() && nested.FullName().Parent().Append("rank_cursors") == rankCursors {
			continue
		}
		pnested := py.Messages().ByName(nested.Name())
		if pnested == nil {
			t.Errorf("python has no nested message %s", nested.FullName())
			continue
		}
		compareMessages(t, nested, pnested)
	}
}

func reservedRanges(md protoreflect.MessageDescriptor) [][2]protoreflect.FieldNumber {
	out := [][2]protoreflect.FieldNumber{}
	for i := 0; i < md.ReservedRanges().Len(); i++ {
		out = append(out, md.ReservedRanges().Get(i))
	}
	return out
}

func reservedNames(md protoreflect.MessageDescriptor) []protoreflect.Name {
	out := []protoreflect.Name{}
	for i := 0; i < md.ReservedNames().Len(); i++ {
		out = append(out, md.ReservedNames().Get(i))
	}
	return out
}

// TestServicesMatchPython checks the three engine services kvrelay serves:
// same full names, and every method kvrelay declares (SubscribeKvEvents;
// the rest of each engine's service is forwarded, not declared) exists in
// SMG's service with the same request/response types and streaming.
func TestServicesMatchPython(t *testing.T) {
	pyFiles := pythonDescriptors(t)
	cases := []struct {
		pyFile     string
		ours       protoreflect.FileDescriptor
		fullMethod string
	}{
		{"sglang_scheduler.proto", kvpb.File_smg_sglang_scheduler_proto, kvpb.SglangScheduler_SubscribeKvEvents_FullMethodName},
		{"vllm_engine.proto", kvpb.File_smg_vllm_engine_proto, kvpb.VllmEngine_SubscribeKvEvents_FullMethodName},
		{"tokenspeed_scheduler.proto", kvpb.File_smg_tokenspeed_scheduler_proto, kvpb.TokenSpeedScheduler_SubscribeKvEvents_FullMethodName},
	}
	for _, tc := range cases {
		t.Run(tc.pyFile, func(t *testing.T) {
			pf := pyFiles[tc.pyFile]
			if pf == nil {
				t.Fatalf("python sent no %s", tc.pyFile)
			}
			if tc.ours.Services().Len() != 1 || len(pf.GetService()) != 1 {
				t.Fatalf("services: ours %d, python %d; want one each", tc.ours.Services().Len(), len(pf.GetService()))
			}
			sd := tc.ours.Services().Get(0)
			psd := pf.GetService()[0]
			pyFull := pf.GetPackage() + "." + psd.GetName()
			if string(sd.FullName()) != pyFull {
				t.Fatalf("service %s, python %s", sd.FullName(), pyFull)
			}
			pyMethods := map[string]*descriptorpb.MethodDescriptorProto{}
			for _, m := range psd.GetMethod() {
				pyMethods[m.GetName()] = m
			}
			for i := 0; i < sd.Methods().Len(); i++ {
				md := sd.Methods().Get(i)
				pm := pyMethods[string(md.Name())]
				if pm == nil {
					t.Errorf("python's %s has no method %s", pyFull, md.Name())
					continue
				}
				got := [4]string{"." + string(md.Input().FullName()), "." + string(md.Output().FullName()),
					boolString(md.IsStreamingClient()), boolString(md.IsStreamingServer())}
				want := [4]string{pm.GetInputType(), pm.GetOutputType(),
					boolString(pm.GetClientStreaming()), boolString(pm.GetServerStreaming())}
				if got != want {
					t.Errorf("%s/%s: ours (in, out, client-streaming, server-streaming) %v, python %v", pyFull, md.Name(), got, want)
				}
			}
			if want := "/" + pyFull + "/SubscribeKvEvents"; tc.fullMethod != want {
				t.Errorf("gRPC method path %s, python's %s", tc.fullMethod, want)
			}
		})
	}
}

func boolString(b bool) string {
	if b {
		return "true"
	}
	return "false"
}

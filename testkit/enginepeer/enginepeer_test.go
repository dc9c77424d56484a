package enginepeer

import (
	"encoding/json"
	"os/exec"
	"strings"
	"testing"

	"go.uber.org/goleak"

	"github.com/kvrelay/kvrelay/testkit/pyenv"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

func TestHashJSON(t *testing.T) {
	tests := []struct {
		h    Hash
		want string
	}{
		{U64(1<<64 - 1), "18446744073709551615"},
		{I64(-3488128144981237669), "-3488128144981237669"},
		{U64(0), "0"},
		{Digest([]byte{0xab, 0x01}), `{"bytes":"ab01"}`},
	}
	for _, tt := range tests {
		b, err := json.Marshal(tt.h)
		if err != nil || string(b) != tt.want {
			t.Errorf("Marshal = %s, %v; want %s", b, err, tt.want)
		}
	}
}

func TestSeqRingDropAndBurn(t *testing.T) {
	p := Start(t, Options{Engine: VLLM, DPSize: 2, BufferSteps: 3})
	if len(p.Ranks()) != 2 || p.PubEndpoint(1) == "" || p.ReplayEndpoint(1) == "" {
		t.Fatalf("ranks %+v", p.Ranks())
	}
	var got []Published
	publish := func() {
		t.Helper()
		pub, err := p.Publish(1, Removed(U64(7)))
		if err != nil {
			t.Fatal(err)
		}
		got = append(got, pub)
	}
	publish()
	publish()
	if err := p.DropNext(1, 1); err != nil {
		t.Fatal(err)
	}
	publish()
	if err := p.BurnNext(1, 1); err != nil {
		t.Fatal(err)
	}
	publish()
	publish()
	want := []Published{
		{0, true, true}, {1, true, true}, {2, false, true}, {3, false, false}, {4, true, true},
	}
	for i := range want {
		if got[i] != want[i] {
			t.Errorf("publish %d = %+v, want %+v", i, got[i], want[i])
		}
	}
	st, err := p.Status()
	if err != nil {
		t.Fatal(err)
	}
	r := st[1]
	// Ring of 3 holds seqs 1, 2 (dropped live) and 4; 3 was burned.
	if r.NextSeq != 5 || r.RingLen != 3 || r.RingFirst == nil || *r.RingFirst != 1 || *r.RingLast != 4 {
		t.Errorf("rank 1 status %+v", r)
	}
	if st[0].NextSeq != 0 || st[0].RingLen != 0 || st[0].RingFirst != nil {
		t.Errorf("rank 0 status %+v", st[0])
	}

	if err := p.Restart(1); err != nil {
		t.Fatal(err)
	}
	st, err = p.Status()
	if err != nil {
		t.Fatal(err)
	}
	if st[1].NextSeq != 0 || st[1].RingLen != 0 {
		t.Errorf("after restart %+v", st[1])
	}
}

func TestBadCommandsKeepPeerUsable(t *testing.T) {
	p := Start(t, Options{Engine: SGLang, NoReplay: true})
	if p.ReplayEndpoint(0) != "" {
		t.Errorf("replay endpoint %q without replay", p.ReplayEndpoint(0))
	}
	tests := []struct {
		name string
		call func() error
		want string
	}{
		{"no such rank", func() error { _, err := p.Publish(3, Cleared()); return err }, "no rank"},
		{"unknown field", func() error {
			_, err := p.Publish(0, Event{Type: "stored", Fields: map[string]any{"lora_name": "x"}})
			return err
		}, "no field"},
		{"unknown event", func() error { _, err := p.Publish(0, Event{Type: "moved"}); return err }, "unknown event"},
		{"bad count", func() error { _, _, err := p.PublishMany(0, 0, 0); return err }, "count"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := tt.call()
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("err = %v, want one mentioning %q", err, tt.want)
			}
		})
	}
	// SGLang's startup clear took seq 0; nothing above consumed a seq.
	pub, err := p.Publish(0, Cleared())
	if err != nil || pub.Seq != 1 {
		t.Fatalf("publish after errors = %+v, %v; want seq 1", pub, err)
	}
}

func TestClose(t *testing.T) {
	p := Start(t, Options{Engine: TokenSpeed})
	if err := p.Close(); err != nil {
		t.Fatal(err)
	}
	if err := p.Close(); err != nil {
		t.Fatalf("second Close: %v", err)
	}
	if _, err := p.Status(); err == nil {
		t.Fatal("Status after Close succeeded")
	}
}

func TestStartErrors(t *testing.T) {
	if _, err := start(t, Options{}); err == nil {
		t.Error("no error without an engine")
	}
	if _, err := start(t, Options{Engine: "trtllm"}); err == nil || !strings.Contains(err.Error(), "ready") {
		t.Errorf("unknown engine: err %v", err)
	}
	if _, err := start(t, Options{Engine: TokenSpeed, Wire: "map"}); err == nil {
		t.Error("tokenspeed has no map wire, but the peer started")
	}
}

// The peer picks its ROUTER ports clear of its PUB ports. Each range is
// probed with sockets that are closed again, so the kernel may hand the
// PUB's base port to the ROUTER's probe next; both ranks' ROUTERs then
// failed to bind ("Address already in use", seen once in CI). The test
// scripts the kernel's answers: the first probe gets a PUB port, the
// second a free one, and the pick must be the second.
func TestReplayPortsArePickedClearOfThePubPorts(t *testing.T) {
	script := pyenv.Script("peer", "engine_peer.py")
	code := `
import importlib.util, socket, sys
spec = importlib.util.spec_from_file_location("engine_peer", sys.argv[1])
m = importlib.util.module_from_spec(spec)
spec.loader.exec_module(m)
answers = iter([40000, 50000])
class Probe:
    def __init__(self, *a): self.port = None
    def bind(self, addr):
        self.port = next(answers) if addr[1] == 0 else addr[1]
    def getsockname(self): return ("0.0.0.0", self.port)
    def close(self): pass
m.socket.socket = Probe
print(m.pick_base_ports("tcp://*:0", 2, frozenset({40000, 40001})))
`
	out, err := exec.Command(pyenv.Python(t), "-c", code, script).CombinedOutput()
	if err != nil {
		t.Fatalf("%v: %s", err, out)
	}
	if got := strings.TrimSpace(string(out)); got != "50000" {
		t.Fatalf("picked base port %s for the ROUTERs, want 50000: 40000 is a PUB port", got)
	}
}

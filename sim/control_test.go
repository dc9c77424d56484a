package sim

import (
	"bytes"
	"encoding/json"
	"io"
	"net/http"
	"strings"
	"testing"

	"github.com/kvrelay/kvrelay/sim/prefixcache"
)

func httpDo(t *testing.T, method, url, body string) (int, []byte) {
	t.Helper()
	req, err := http.NewRequest(method, url, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return resp.StatusCode, b
}

func TestControlEndpoint(t *testing.T) {
	e := startSim(t, Options{Engine: "sglang", DPSize: 2, ControlAddr: "127.0.0.1:0", HostCapacityBlocks: 4, CapacityBlocks: 6}, "")
	base := "http://" + e.ControlAddr()
	defer http.DefaultClient.CloseIdleConnections()

	if code, body := httpDo(t, "GET", base+"/healthz", ""); code != 200 || string(body) != "ok\n" {
		t.Fatalf("healthz: %d %q", code, body)
	}
	if code, body := httpDo(t, "POST", base+"/run", `{"requests": 30}`); code != 200 {
		t.Fatalf("run: %d %s", code, body)
	}
	code, body := httpDo(t, "POST", base+"/request", `{"rank": 1, "tokens": [1,2,3,4,5,6,7,8]}`)
	if code != 200 {
		t.Fatalf("request: %d %s", code, body)
	}
	var res prefixcache.Result
	if err := json.Unmarshal(body, &res); err != nil || res.TotalBlocks != 2 {
		t.Fatalf("request result %s: %v", body, err)
	}

	code, body = httpDo(t, "GET", base+"/live", "")
	if code != 200 {
		t.Fatalf("live: %d", code)
	}
	var live LiveJSON
	dec := json.NewDecoder(bytes.NewReader(body))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&live); err != nil {
		t.Fatal(err)
	}
	truth := e.LiveSet()
	if live.Engine != "sglang" || live.Wire != "map" || len(live.Ranks) != 2 {
		t.Fatalf("live header %+v", live)
	}
	sawHost := false
	for r, rl := range live.Ranks {
		if rl.Rank != r || rl.NextSeq != truth[r].NextSeq || len(rl.Blocks) != len(truth[r].Blocks) {
			t.Fatalf("rank %d: %+v vs %+v", r, rl, truth[r])
		}
		for i, b := range rl.Blocks {
			tb := truth[r].Blocks[i]
			if b.Hash != int64(tb.Hash) || b.Copies != tb.Copies || b.Tier != tb.Tier.String() || b.Medium != e.Medium(tb.Tier) {
				t.Fatalf("rank %d block %d: %+v vs %+v", r, i, b, tb)
			}
			sawHost = sawHost || b.Tier == "host"
		}
	}
	if !sawHost || len(live.Ranks[1].Blocks) == 0 {
		t.Fatalf("live set lacks host blocks or rank 1: %s", body)
	}

	if code, body := httpDo(t, "POST", base+"/fault", `{"kind": "restart", "rank": 0}`); code != 200 {
		t.Fatalf("fault: %d %s", code, body)
	}
	if ls := e.LiveSet(); len(ls[0].Blocks) != 0 || ls[0].NextSeq != 1 || len(ls[1].Blocks) == 0 {
		t.Fatalf("after restart of rank 0: %+v", ls)
	}
	if code, body := httpDo(t, "GET", base+"/stats", ""); code != 200 || !bytes.Contains(body, []byte(`"publishers"`)) || !bytes.Contains(body, []byte(`"device_hits"`)) {
		t.Fatalf("stats: %d %s", code, body)
	}

	bad := []struct{ method, path, body, want string }{
		{"POST", "/fault", `{"kind": "explode"}`, "unknown fault kind"},
		{"POST", "/fault", `{"kind": "restart", "rank": 7}`, "rank 7"},
		{"POST", "/fault", `{"knd": "restart"}`, "unknown field"},
		{"POST", "/fault", `{}`, "missing"},
		{"POST", "/fault", `{"kind": "drop_every", "n": -2}`, "negative"},
		{"POST", "/fault", `{"kind": "pause"} {}`, "trailing"},
		{"POST", "/request", `{"rank": 5, "tokens": [1]}`, "rank 5"},
		{"POST", "/request", `{"rank": 0, "tokens": [-1]}`, "request body"},
		{"POST", "/run", `{"requests": -1}`, "negative"},
	}
	for _, tc := range bad {
		code, body := httpDo(t, tc.method, base+tc.path, tc.body)
		if code != http.StatusBadRequest || !strings.Contains(string(body), tc.want) {
			t.Errorf("%s %s %s: %d %s (want 400 mentioning %q)", tc.method, tc.path, tc.body, code, body, tc.want)
		}
	}
	if code, _ := httpDo(t, "GET", base+"/fault", ""); code != http.StatusMethodNotAllowed {
		t.Errorf("GET /fault: %d", code)
	}
}

// FuzzDecodeFault feeds the control endpoint's fault decoder arbitrary
// bodies: it must return a fault or an error, never panic.
func FuzzDecodeFault(f *testing.F) {
	for _, s := range []string{`{"kind":"restart"}`, `{"kind":"drop_every","n":3,"rank":1}`, `{"kind":1}`, `[]`, ``, `{"kind":"pause"}{`} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		fl, err := decodeFault(bytes.NewReader(b))
		if err == nil && fl.Kind == "" {
			t.Fatal("accepted a fault without a kind")
		}
	})
}

// FuzzParseReplayRequest feeds the ROUTER's request parser arbitrary
// frames.
func FuzzParseReplayRequest(f *testing.F) {
	f.Add([]byte("id"), []byte{}, []byte{0, 0, 0, 0, 0, 0, 0, 5}, uint8(3))
	f.Add([]byte("id"), []byte{}, []byte{1, 0, 0, 0, 0, 0, 0, 0, 0}, uint8(3))
	f.Add([]byte{}, []byte{}, []byte{}, uint8(2))
	f.Fuzz(func(t *testing.T, a, b, c []byte, n uint8) {
		frames := [][]byte{a, b, c, a}[:min(int(n)%5, 4)]
		id, start, ok := parseReplayRequest(frames)
		if ok != (len(frames) == 3) {
			t.Fatalf("%d frames: ok %v", len(frames), ok)
		}
		if ok && !bytes.Equal(id, a) {
			t.Fatal("identity not taken from frame 0")
		}
		if ok && len(c) <= 8 {
			var want uint64
			for _, x := range c {
				want = want<<8 | uint64(x)
			}
			if start != want {
				t.Fatalf("start %d, want %d", start, want)
			}
		}
	})
}

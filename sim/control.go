package sim

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"time"
)

// maxControlBody bounds request bodies: the largest legitimate one is a
// single prompt's token list.
const maxControlBody = 8 << 20

// LiveJSON is GET /live's body.
type LiveJSON struct {
	Engine string         `json:"engine"`
	Wire   string         `json:"wire"`
	Ranks  []RankLiveJSON `json:"ranks"`
}

// RankLiveJSON is one rank in LiveJSON.
type RankLiveJSON struct {
	Rank    int             `json:"rank"`
	NextSeq uint64          `json:"next_seq"`
	Blocks  []LiveBlockJSON `json:"blocks"`
}

// LiveBlockJSON is one live block. Hash is the 64-bit pattern as a signed
// integer, the form the SMG proto (int64 block_hash) carries for every
// engine.
type LiveBlockJSON struct {
	Tier   string `json:"tier"`
	Medium string `json:"medium,omitempty"`
	Hash   int64  `json:"hash"`
	Copies int    `json:"copies"`
}

// RequestJSON is POST /request's body: one prompt for one rank.
type RequestJSON struct {
	Rank   int      `json:"rank"`
	Tokens []uint32 `json:"tokens"`
}

// RunJSON is POST /run's body: serve that many built-in requests.
type RunJSON struct {
	Requests int `json:"requests"`
}

// LiveJSON renders LiveSet for the control endpoint.
func (e *Engine) LiveJSON() LiveJSON {
	out := LiveJSON{Engine: e.prof.Name, Wire: e.wire.gen, Ranks: []RankLiveJSON{}}
	for _, rl := range e.LiveSet() {
		r := RankLiveJSON{Rank: rl.Rank, NextSeq: rl.NextSeq, Blocks: make([]LiveBlockJSON, 0, len(rl.Blocks))}
		for _, b := range rl.Blocks {
			r.Blocks = append(r.Blocks, LiveBlockJSON{Tier: b.Tier.String(), Medium: e.wire.medium(b.Tier), Hash: int64(b.Hash), Copies: b.Copies})
		}
		out.Ranks = append(out.Ranks, r)
	}
	return out
}

// ControlHandler serves the control and inspection endpoint:
//
//	GET  /healthz  liveness
//	GET  /live     true live set and next sequence per rank (LiveJSON)
//	GET  /stats    cache outcome totals and publisher counters
//	POST /fault    inject a Fault (JSON body)
//	POST /request  serve one prompt on one rank (RequestJSON) as a step
//	POST /run      serve N built-in requests (RunJSON)
//	GET  /metrics  the engine's load as its Prometheus exposition (load.go)
//	GET  /v1/loads SGLang's load report (SGLang only)
func (e *Engine) ControlHandler() http.Handler {
	mux := http.NewServeMux()
	e.serveLoad(mux)
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, r *http.Request) {
		io.WriteString(w, "ok\n")
	})
	mux.HandleFunc("GET /live", func(w http.ResponseWriter, r *http.Request) {
		writeJSON(w, http.StatusOK, e.LiveJSON())
	})
	mux.HandleFunc("GET /stats", func(w http.ResponseWriter, r *http.Request) {
		writeJSON(w, http.StatusOK, struct {
			Cache      Stats            `json:"cache"`
			Publishers []PublisherStats `json:"publishers"`
		}{e.Stats(), e.PublisherStats()})
	})
	mux.HandleFunc("POST /fault", func(w http.ResponseWriter, r *http.Request) {
		f, err := decodeFault(http.MaxBytesReader(w, r.Body, maxControlBody))
		if err != nil {
			writeError(w, http.StatusBadRequest, err)
			return
		}
		if err := e.Fault(f); err != nil {
			writeError(w, http.StatusBadRequest, err)
			return
		}
		writeJSON(w, http.StatusOK, map[string]bool{"ok": true})
	})
	mux.HandleFunc("POST /request", func(w http.ResponseWriter, r *http.Request) {
		var req RequestJSON
		if err := decodeStrict(http.MaxBytesReader(w, r.Body, maxControlBody), &req); err != nil {
			writeError(w, http.StatusBadRequest, fmt.Errorf("request body: %w", err))
			return
		}
		res, err := e.Step(Request(req))
		if err != nil {
			writeError(w, http.StatusBadRequest, err)
			return
		}
		writeJSON(w, http.StatusOK, res.Results[0])
	})
	mux.HandleFunc("POST /run", func(w http.ResponseWriter, r *http.Request) {
		var req RunJSON
		if err := decodeStrict(http.MaxBytesReader(w, r.Body, maxControlBody), &req); err != nil {
			writeError(w, http.StatusBadRequest, fmt.Errorf("run body: %w", err))
			return
		}
		if req.Requests < 0 {
			writeError(w, http.StatusBadRequest, fmt.Errorf("run body: requests %d must not be negative", req.Requests))
			return
		}
		s, err := e.RunWorkload(req.Requests)
		if err != nil {
			writeError(w, http.StatusInternalServerError, err)
			return
		}
		writeJSON(w, http.StatusOK, s)
	})
	return mux
}

// decodeFault reads a Fault strictly, so a misspelt field is an error
// rather than a silently different fault.
func decodeFault(r io.Reader) (Fault, error) {
	var f Fault
	if err := decodeStrict(r, &f); err != nil {
		return f, fmt.Errorf("fault body: %w", err)
	}
	if f.Kind == "" {
		return f, errors.New("fault body: missing \"kind\"")
	}
	return f, nil
}

func decodeStrict(r io.Reader, v any) error {
	dec := json.NewDecoder(r)
	dec.DisallowUnknownFields()
	if err := dec.Decode(v); err != nil {
		return err
	}
	if _, err := dec.Token(); !errors.Is(err, io.EOF) {
		return errors.New("trailing data after the JSON object")
	}
	return nil
}

func writeJSON(w http.ResponseWriter, code int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(code)
	json.NewEncoder(w).Encode(v)
}

func writeError(w http.ResponseWriter, code int, err error) {
	writeJSON(w, code, map[string]string{"error": err.Error()})
}

func (e *Engine) serveControl(addr string) error {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return fmt.Errorf("control endpoint: %w", err)
	}
	e.ctlLn = ln
	e.ctlSrv = &http.Server{Handler: e.ControlHandler(), ReadHeaderTimeout: 10 * time.Second}
	e.ctlDone = make(chan struct{})
	go func() {
		defer close(e.ctlDone)
		if err := e.ctlSrv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
			e.log.Error("control endpoint stopped", "err", err)
		}
	}()
	return nil
}

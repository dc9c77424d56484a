// Package httpapi is the gateway's HTTP API, what `kvrelay gateway` serves:
// routing (/v1/route), request completion (/v1/done), caller-reported loads
// (/v1/load), the workers' state (/v1/workers), liveness and readiness, and
// the metrics. It turns JSON bodies into gateway calls and answers every bad
// body with a status and a message in the API's terms; Limits bound what a
// client can make it hold.
package httpapi

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"reflect"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/kvrelay/kvrelay/gateway"
	"github.com/kvrelay/kvrelay/gateway/monitor"
	"github.com/kvrelay/kvrelay/internal/logthrottle"
	"github.com/kvrelay/kvrelay/internal/webserve"
)

// Serve runs g and its HTTP API on ln until ctx ends, then shuts the HTTP
// server down gracefully and waits for the subscriptions to stop. reg is
// what /metrics exposes; webConfig an exporter-toolkit web config ("" none);
// extra adds routes of other packages (the membership admin API).
func Serve(ctx context.Context, log *slog.Logger, g *gateway.Gateway, reg *prometheus.Registry, ln net.Listener, webConfig string, lim Limits, extra ...func(*http.ServeMux)) error {
	runCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	runDone := make(chan error, 1)
	go func() { runDone <- g.Run(runCtx) }()

	// webserve.Serve adds its ReadHeaderTimeout (10 s) and an ErrorLog
	// throttled per kind of line (a flood of bad TLS handshakes or
	// malformed requests yields a few lines a minute).
	srv := &http.Server{
		Handler: NewHandler(g, reg, log, lim, extra...),
		// A body trickled in holds its request (and its share of the
		// in-flight cap) no longer than this, and below MinUploadRate
		// no longer than a few seconds (uploadrate.go).
		ReadTimeout: lim.ReadTimeout,
		IdleTimeout: 2 * time.Minute,
	}
	serveDone := make(chan error, 1)
	go func() { serveDone <- webserve.Serve(srv, ln, webConfig, log) }()
	log.Info("gateway listening", "addr", ln.Addr().String(), "models", g.Models())

	var serveErr, runErr error
	ran := false // Run returned: it ended early, and the API serves nothing true
	select {
	case <-ctx.Done():
	case serveErr = <-serveDone:
	case runErr = <-runDone:
		ran = true
		if runErr == nil {
			runErr = errors.New("Run returned before shutdown")
		}
	}
	shutCtx, shutCancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer shutCancel()
	if err := srv.Shutdown(shutCtx); err != nil {
		log.Warn("HTTP shutdown", "err", err)
	}
	if serveErr == nil {
		if err := <-serveDone; err != nil && !errors.Is(err, http.ErrServerClosed) {
			serveErr = err
		}
	}
	cancel()
	if !ran {
		runErr = <-runDone
	}
	if runErr != nil {
		return fmt.Errorf("gateway: %w", runErr)
	}
	if serveErr != nil && !errors.Is(serveErr, http.ErrServerClosed) {
		return fmt.Errorf("http: %w", serveErr)
	}
	log.Info("gateway stopped")
	return nil
}

// Limits bound what HTTP clients can make the gateway hold.
type Limits struct {
	// MaxTokens bounds the token ids of one request, and through them the
	// body: each id takes at most 11 bytes of JSON ("4294967295,").
	MaxTokens int
	// MaxInFlight bounds the POST requests handled at once, so bodies and
	// decoded token arrays take at most MaxInFlight × the body bound.
	MaxInFlight int
	// MaxInFlightPerClient bounds the POST requests of one client address
	// handled at once, so a client whose uploads trickle in (slow loris)
	// holds that many of MaxInFlight's slots, not all; 0 = MaxInFlight/8,
	// at least 1.
	MaxInFlightPerClient int
	// ReadTimeout bounds reading a whole request.
	ReadTimeout time.Duration
	// MinUploadRate is the least average rate, in bytes a second, a POST
	// body must arrive at from UploadGrace on; a slower one is answered
	// 408 and its connection closed (uploadrate.go). 0 = none.
	MinUploadRate float64
}

// DefaultLimits: a million-token prompt (the longest contexts served
// today) is routable; 64 bodies of that size are under 1 GiB, and routing
// takes microseconds, so 64 at once is far above what two cores get through
// anyway.
var DefaultLimits = Limits{MaxTokens: 1 << 20, MaxInFlight: 64, ReadTimeout: 30 * time.Second, MinUploadRate: DefaultMinUploadRate}

// MaxRequestTokensCap keeps the body bound within an int on any platform.
const MaxRequestTokensCap = 1 << 26

// bodyLimit is the largest body accepted: the token array at its bound plus
// room for the other fields (a loads map naming many workers).
func (l Limits) bodyLimit() int64 { return int64(l.MaxTokens)*11 + 256<<10 }

// routeRequest is the /v1/route body. Pointers tell a missing field from a
// zero one.
type routeRequest struct {
	Model    string    `json:"model"`
	TokenIDs *[]uint32 `json:"token_ids"`
	// Text, for a client without a tokenizer, is used when token_ids is
	// absent: prefix affinity from the gateway's placements only.
	Text      *string         `json:"text"`
	LoraName  string          `json:"lora_name"`
	CacheSalt string          `json:"cache_salt"`
	Loads     map[string]*int `json:"loads"`
	// Track counts the request in its worker's in-flight load until POST
	// /v1/done names its request_id.
	Track bool `json:"track"`
}

type routeResponse struct {
	Worker        string         `json:"worker"`
	Model         string         `json:"model"`
	Reason        string         `json:"reason"`
	MatchedBlocks map[string]int `json:"matched_blocks"`
	BlockSize     int            `json:"block_size"`
	RequestBlocks int            `json:"request_blocks"`
	RequestID     uint64         `json:"request_id,omitempty"`
}

// doneRequest is the /v1/done body: {"request_id": N} from a tracked route.
type doneRequest struct {
	RequestID *uint64 `json:"request_id"`
}

// loadRequest is the /v1/load body: {"loads": {"worker": inflight, ...}}.
type loadRequest struct {
	Loads map[string]*int `json:"loads"`
}

// maxListedCatchingUp bounds the workers /readyz names as catching up.
const maxListedCatchingUp = 20

// NewHandler is the gateway's HTTP API: /v1/route, /v1/done, /v1/load,
// /v1/workers, /healthz, /readyz and /metrics (reg's), and what extra
// adds to the same mux (behind the same listener and its protection).
func NewHandler(g *gateway.Gateway, reg *prometheus.Registry, log *slog.Logger, lim Limits, extra ...func(*http.ServeMux)) http.Handler {
	mux := http.NewServeMux()
	for _, add := range extra {
		add(mux)
	}
	rej := newRejections(reg, log)
	writeError := rej.write
	// own holds the API's own patterns, whose handlers count their
	// refusals themselves; any other answer of 400 or more (no route, or
	// a route extra added) is counted by the handler returned.
	own := map[string]bool{"GET /metrics": true}
	handleFunc := func(pattern string, h http.HandlerFunc) {
		own[pattern] = true
		mux.HandleFunc(pattern, h)
	}
	inflight := make(chan struct{}, lim.MaxInFlight)
	perClient := newClientSlots(lim.perClient())
	// bounded admits a POST only while fewer than MaxInFlightPerClient of
	// its client's and MaxInFlight in all are handled; a refused client is
	// told when to come back. Its body must arrive at MinUploadRate.
	bounded := func(h http.HandlerFunc) http.HandlerFunc {
		return func(w http.ResponseWriter, r *http.Request) {
			client := clientKey(r)
			if !perClient.take(client) {
				// Close after the reply: else the server reads the rest of
				// the body (which a slow client trickles) before replying.
				w.Header().Set("Connection", "close")
				w.Header().Set("Retry-After", "1")
				writeError(w, r, http.StatusServiceUnavailable, fmt.Sprintf("this client has %d requests in flight already (the per-client bound); retry shortly", perClient.max))
				dropUnreadBody(w)
				return
			}
			defer perClient.give(client)
			select {
			case inflight <- struct{}{}:
				defer func() { <-inflight }()
				if lim.MinUploadRate > 0 {
					r.Body = newRateBody(w, r, lim.MinUploadRate, lim.ReadTimeout)
				}
				h(w, r)
			default:
				// As above: the slow client that finds the gateway full
				// must not hold a connection while its body trickles in.
				w.Header().Set("Connection", "close")
				w.Header().Set("Retry-After", "1")
				writeError(w, r, http.StatusServiceUnavailable, fmt.Sprintf("the gateway is handling %d requests already (--max-inflight-requests); retry shortly", lim.MaxInFlight))
				dropUnreadBody(w)
			}
		}
	}
	handleFunc("POST /v1/route", bounded(func(w http.ResponseWriter, r *http.Request) {
		var req routeRequest
		if code, err := decodeBody(w, r, &req, lim); err != nil {
			writeError(w, r, code, err.Error())
			return
		}
		var toks []uint32
		var text string
		switch {
		case req.TokenIDs != nil:
			toks = *req.TokenIDs
		case req.Text != nil:
			text = *req.Text
		default:
			writeError(w, r, http.StatusBadRequest, `"token_ids" (an array of token ids) or "text" is required`)
			return
		}
		if n := len(toks); n > lim.MaxTokens {
			writeError(w, r, http.StatusRequestEntityTooLarge, fmt.Sprintf(`"token_ids" holds %d tokens; this gateway takes at most %d (--max-request-tokens)`, n, lim.MaxTokens))
			return
		}
		loads, err := checkLoads(req.Loads)
		if err != nil {
			writeError(w, r, http.StatusBadRequest, err.Error())
			return
		}
		d, err := g.Route(gateway.RouteRequest{
			Model: req.Model, TokenIDs: toks, Text: text, LoraName: req.LoraName, CacheSalt: req.CacheSalt, Loads: loads,
			Track: req.Track,
		})
		switch {
		case errors.Is(err, gateway.ErrUnknownWorker):
			writeError(w, r, http.StatusBadRequest, "loads: "+err.Error())
			return
		case errors.Is(err, gateway.ErrUnknownModel):
			writeError(w, r, http.StatusNotFound, err.Error())
			return
		case errors.Is(err, gateway.ErrNoWorkers):
			writeError(w, r, http.StatusServiceUnavailable, err.Error())
			return
		case err != nil:
			log.Error("route failed", "err", err)
			writeError(w, r, http.StatusInternalServerError, err.Error())
			return
		}
		writeJSON(w, http.StatusOK, routeResponse{
			Worker: d.Worker, Model: d.Model, Reason: string(d.Reason), MatchedBlocks: d.MatchedBlocks,
			BlockSize: d.BlockSize, RequestBlocks: d.RequestBlocks, RequestID: d.RequestID,
		})
	}))
	handleFunc("POST /v1/done", bounded(func(w http.ResponseWriter, r *http.Request) {
		var req doneRequest
		if code, err := decodeBody(w, r, &req, lim); err != nil {
			writeError(w, r, code, err.Error())
			return
		}
		if req.RequestID == nil {
			writeError(w, r, http.StatusBadRequest, `"request_id" is required (from a /v1/route answer with "track": true)`)
			return
		}
		if err := g.Complete(*req.RequestID); err != nil {
			writeError(w, r, http.StatusNotFound, err.Error())
			return
		}
		writeJSON(w, http.StatusOK, map[string]bool{"completed": true})
	}))
	handleFunc("POST /v1/load", bounded(func(w http.ResponseWriter, r *http.Request) {
		var req loadRequest
		if code, err := decodeBody(w, r, &req, lim); err != nil {
			writeError(w, r, code, err.Error())
			return
		}
		if len(req.Loads) == 0 {
			writeError(w, r, http.StatusBadRequest, `"loads" is required: {"loads": {"WORKER": INFLIGHT}}`)
			return
		}
		loads, err := checkLoads(req.Loads)
		if err != nil {
			writeError(w, r, http.StatusBadRequest, err.Error())
			return
		}
		if err := g.ReportLoads(loads); err != nil {
			writeError(w, r, http.StatusBadRequest, "loads: "+err.Error())
			return
		}
		writeJSON(w, http.StatusOK, map[string]int{"accepted": len(loads)})
	}))
	// Liveness: the process serves HTTP.
	handleFunc("GET /healthz", func(w http.ResponseWriter, r *http.Request) {
		writeJSON(w, http.StatusOK, map[string]string{"status": "ok"})
	})
	// Readiness: every model that has workers has one whose stream is
	// open, so its routing rests on a live index. On a partitioned replica
	// only its own partition's workers stream here (the others show
	// gateway.StateRemote): a model is ready when one of its own workers
	// streams, or when it has none of its own (the other partitions' replicas
	// answer for those, and say their readiness themselves). A partitioned
	// replica is ready, besides, only once it answers its partition's
	// lookups (gateway.Gateway.AnsweringPartition): a restarted one holds
	// them back until its own workers' indexes are whole, and its own
	// routes would rest on the same partial index meanwhile.
	handleFunc("GET /readyz", func(w http.ResponseWriter, r *http.Request) {
		type state struct{ own, streaming bool }
		models := map[string]state{}
		for _, ws := range g.Workers() {
			st := models[ws.Model]
			st.own = st.own || ws.State != gateway.StateRemote
			st.streaming = st.streaming || ws.State == monitor.StateStreaming
			models[ws.Model] = st
		}
		waiting := []string{}
		for m, st := range models {
			if st.own && !st.streaming {
				waiting = append(waiting, m)
			}
		}
		sort.Strings(waiting)
		if !g.AnsweringPartition() {
			behind := g.CatchingUp()
			writeJSON(w, http.StatusServiceUnavailable, map[string]any{
				"status": "not ready", "models_without_a_stream": waiting,
				"partition_answering": false, "workers_catching_up": len(behind),
				"catching_up": append([]string{}, behind[:min(len(behind), maxListedCatchingUp)]...),
			})
			return
		}
		if len(waiting) > 0 {
			writeJSON(w, http.StatusServiceUnavailable, map[string]any{"status": "not ready", "models_without_a_stream": waiting})
			return
		}
		writeJSON(w, http.StatusOK, map[string]string{"status": "ready"})
	})
	handleFunc("GET /v1/workers", func(w http.ResponseWriter, r *http.Request) {
		writeJSON(w, http.StatusOK, Workers{Workers: g.Workers()})
	})
	mux.Handle("GET /metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{Registry: reg}))
	// A path or method no route takes is a rejection too (404, 405), and
	// so is a refusal of a route extra added (the membership admin API's
	// 403 while the listener is unprotected, say).
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, pattern := mux.Handler(r)
		if own[pattern] {
			mux.ServeHTTP(w, r)
			return
		}
		rec := &codeRecorder{ResponseWriter: w}
		mux.ServeHTTP(rec, r)
		if rec.code >= 400 {
			reason := "no route"
			if pattern != "" {
				reason = "refused by " + pattern
			}
			rej.count(r, rec.code, reason)
		}
	})
}

// codeRecorder keeps the status a handler answers with.
type codeRecorder struct {
	http.ResponseWriter
	code int
}

func (c *codeRecorder) WriteHeader(code int) {
	if c.code == 0 {
		c.code = code
	}
	c.ResponseWriter.WriteHeader(code)
}

// Unwrap lets http.ResponseController reach the connection.
func (c *codeRecorder) Unwrap() http.ResponseWriter { return c.ResponseWriter }

// checkLoads validates in-flight counts (the gateway checks the names).
// MaxReportedLoad bounds a client-reported in-flight count: far above what
// any engine runs at once, far below what would overflow a sum of counts
// (issue 29: /v1/load took MaxInt64).
const MaxReportedLoad = 1 << 20

func checkLoads(in map[string]*int) (map[string]int, error) {
	if len(in) == 0 {
		return nil, nil
	}
	out := make(map[string]int, len(in))
	for w, n := range in {
		if n == nil || *n < 0 || *n > MaxReportedLoad {
			return nil, fmt.Errorf("loads: %q must be a count ≥ 0 and ≤ %d", w, MaxReportedLoad)
		}
		out[w] = *n
	}
	return out, nil
}

// decodeBody reads one JSON object from a bounded body; on failure, the
// status to answer and a message in the API's terms (no Go type names).
func decodeBody(w http.ResponseWriter, r *http.Request, v any, lim Limits) (int, error) {
	dec := json.NewDecoder(http.MaxBytesReader(w, r.Body, lim.bodyLimit()))
	if err := dec.Decode(v); err != nil {
		var tooBig *http.MaxBytesError
		if errors.As(err, &tooBig) {
			return http.StatusRequestEntityTooLarge, fmt.Errorf("body over %d bytes; this gateway takes at most %d tokens per request (--max-request-tokens)", tooBig.Limit, lim.MaxTokens)
		}
		if errors.Is(err, errUploadTooSlow) {
			w.Header().Set("Connection", "close")
			return http.StatusRequestTimeout, fmt.Errorf("the body arrived slower than %.0f bytes/s (--min-upload-rate, counted from %v in)", lim.MinUploadRate, UploadGrace)
		}
		if errors.Is(err, errReadTimeout) || errors.Is(err, os.ErrDeadlineExceeded) {
			w.Header().Set("Connection", "close")
			return http.StatusRequestTimeout, fmt.Errorf("the body did not arrive within %v (--http-read-timeout)", lim.ReadTimeout)
		}
		if errors.Is(err, io.EOF) {
			return http.StatusBadRequest, errors.New("empty body: want a JSON object")
		}
		return http.StatusBadRequest, fmt.Errorf("bad JSON body: %s", describeJSONError(err))
	}
	if dec.More() {
		return http.StatusBadRequest, errors.New("bad JSON body: trailing data after the object")
	}
	return 0, nil
}

// describeJSONError says what is wrong with a body in JSON terms:
// encoding/json's own messages name Go types and struct fields.
func describeJSONError(err error) string {
	var syntax *json.SyntaxError
	var typ *json.UnmarshalTypeError
	switch {
	case errors.As(err, &syntax):
		return fmt.Sprintf("%s (at byte %d)", strings.TrimPrefix(syntax.Error(), "json: "), syntax.Offset)
	case errors.As(err, &typ):
		if typ.Field == "" {
			return fmt.Sprintf("want a JSON object, got %s", typ.Value)
		}
		return fmt.Sprintf("%q: want %s, got %s", typ.Field, jsonKind(typ.Type), typ.Value)
	case errors.Is(err, io.ErrUnexpectedEOF):
		return "the body ends in the middle of a value"
	}
	return "not a valid JSON object"
}

// jsonKind names what a field of type t takes, in JSON words.
func jsonKind(t reflect.Type) string {
	switch t.Kind() {
	case reflect.Uint32:
		return "an integer 0..4294967295"
	case reflect.Int, reflect.Int64, reflect.Int32:
		return "an integer"
	case reflect.String:
		return "a string"
	case reflect.Slice, reflect.Array:
		return "an array"
	case reflect.Map, reflect.Struct:
		return "an object"
	case reflect.Pointer:
		return jsonKind(t.Elem())
	}
	return "another type"
}

func writeJSON(w http.ResponseWriter, code int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(code)
	_ = json.NewEncoder(w).Encode(v)
}

func writeError(w http.ResponseWriter, code int, msg string) {
	writeJSON(w, code, map[string]string{"error": msg})
}

// rejections counts and logs every request the API refuses.
type rejections struct {
	total *prometheus.CounterVec // code
	log   *slog.Logger           // throttled: clients drive it
}

// newRejections registers kvrelay_gateway_http_rejected_total with reg
// (or takes the one registered already: a second handler on one
// registry counts into the same).
func newRejections(reg prometheus.Registerer, log *slog.Logger) *rejections {
	c := prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "kvrelay_gateway_http_rejected_total",
		Help: "Requests the gateway's HTTP API refused, by status code: 400 bad body, 404 unknown model, request or path, 405 wrong method, 408 body too slow (--min-upload-rate, --http-read-timeout), 413 too large, 503 over an in-flight bound or no workers, 500 routing failed; the membership admin API's by theirs (403 while the listener is unprotected). Basic-auth failures (401) are answered by the web config's handler before the API and are not counted.",
	}, []string{"code"})
	for _, code := range []int{400, 404, 405, 408, 413, 503} {
		c.WithLabelValues(strconv.Itoa(code))
	}
	if reg != nil {
		if err := reg.Register(c); err != nil {
			var are prometheus.AlreadyRegisteredError
			if errors.As(err, &are) {
				if ex, ok := are.ExistingCollector.(*prometheus.CounterVec); ok {
					c = ex
				}
			}
		}
	}
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	return &rejections{total: c, log: logthrottle.Wrap(log)}
}

// write answers r with code and msg, counts it, and logs it at most a few
// lines a minute per code.
func (j *rejections) write(w http.ResponseWriter, r *http.Request, code int, msg string) {
	j.count(r, code, msg)
	writeError(w, code, msg)
}

func (j *rejections) count(r *http.Request, code int, msg string) {
	j.total.WithLabelValues(strconv.Itoa(code)).Inc()
	j.log.Info("HTTP request rejected: "+strconv.Itoa(code)+" "+http.StatusText(code),
		"client", r.RemoteAddr, "method", r.Method, "path", r.URL.Path, "reason", msg)
}

// dropUnreadBody ends a refused request's connection as soon as its answer
// is out. "Connection: close" alone is not enough: after the handler
// returns, net/http still reads up to 256 KiB of an unread body before it
// closes, so a client that trickles its body would hold the connection
// until --http-read-timeout. A read deadline in the past makes that read
// fail at once.
func dropUnreadBody(w http.ResponseWriter) {
	rc := http.NewResponseController(w)
	_ = rc.Flush()
	_ = rc.SetReadDeadline(time.Now())
}

package demo

import (
	"context"
	"fmt"
	"time"

	"github.com/kvrelay/kvrelay/gateway"
	"github.com/kvrelay/kvrelay/gateway/picker"
	"github.com/kvrelay/kvrelay/sim"
)

// The engines' load, as it reaches routing through kvrelay: each relay reads
// its engine's HTTP server (SGLang's /v1/loads; vLLM's /metrics, its
// /v1/loads being refused) with engines/load, stamps the records on its
// stream, and the gateway's picker reads them. The load checks make one
// engine busy with traffic from outside the gateway (another client's
// traffic, sent straight to the engine) and route a prompt whose cache
// holders are known, so what routing does can only come from that load.

// Load policy knobs of the demo's gateway. The thresholds are above
// anything the comparison's traffic reaches (its engines never queue), so
// they act only in the load checks.
const (
	// overlapDecay de-ranks a holder by its waiting-prefill backlog:
	// overlap ÷ (1 + decay × backlog in request lengths).
	overlapDecay = 1.0
	// overloadUsage: the hottest engine's KV usage above it suspends
	// affinity; balanceUsage: hottest minus coldest above it does.
	overloadUsage = 0.9
	balanceUsage  = 0.6
	// loadWait bounds each wait for a load to show or drain.
	loadWait = 20 * time.Second
)

// LoadCheck is one routing decision on engine load that came through
// kvrelay.
type LoadCheck struct {
	Name string `json:"name"`
	// Detail says what the engines reported and what routing did.
	Detail string `json:"detail"`
	// Idle and Loaded are the decisions for the same prompt before and
	// while the load is on ("worker/reason").
	Idle   string `json:"idle"`
	Loaded string `json:"loaded"`
	Want   string `json:"want"`
	Err    string `json:"error,omitempty"`
}

// Pass reports whether routing under load did what the policy says.
func (c LoadCheck) Pass() bool { return c.Err == "" && c.Loaded == c.Want }

// loadPrompt is n blocks of tokens no workload request shares (above the
// workload's vocabulary), distinct per id.
func loadPrompt(id, blocks int) []uint32 {
	toks := make([]uint32, blocks*blockSize)
	for i := range toks {
		toks[i] = 1<<25 + uint32(id)<<16 + uint32(i)
	}
	return toks
}

// otherClient is another client's traffic on rank 1 of the workers' engines,
// sent straight to them: first requests of promptTokens unique tokens each
// at once, which queue (so the batch slots stay full whatever pace the
// machine allows), then perStep more every 250 ms until stop is called.
// Steady steps rather than one large burst keep each batch moderate, so
// the relays and the gateway carry the load while it lasts even on a
// loaded machine. The checks' prompts live
// on rank 0, whose cache this leaves alone; a worker's load is its
// busiest rank's.
func (d *demo) otherClient(id, first, perStep, promptTokens int, ws ...*worker) (stop func()) {
	done, quit := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(done)
		t := time.NewTicker(250 * time.Millisecond)
		defer t.Stop()
		sent := 0
		for n := 0; ; n++ {
			k := perStep
			if n == 0 {
				k = first
			}
			for _, w := range ws {
				reqs := make([]sim.Request, k)
				for i := range reqs {
					toks := make([]uint32, promptTokens)
					for j := range toks {
						toks[j] = 1<<26 + uint32(id)<<21 + uint32(sent+i)<<10 + uint32(j)
					}
					reqs[i] = sim.Request{Rank: 1, Tokens: toks}
				}
				if _, err := w.eng.Step(reqs...); err != nil {
					d.log.Warn("load check traffic", "worker", w.id, "err", err)
					return
				}
			}
			sent += k
			select {
			case <-quit:
				return
			case <-t.C:
			}
		}
	}()
	return func() { close(quit); <-done }
}

// engineLoad is the gateway's view of worker w: its ranks' highest KV
// usage, their summed waiting uncached tokens, and the age of the newest
// record; ok is false without a record.
func (d *demo) engineLoadOf(w *worker) (usage float64, backlog int, age time.Duration, ok bool) {
	for _, st := range d.gw.gw.Workers() {
		if st.ID != w.id {
			continue
		}
		age = time.Hour
		for _, r := range st.EngineRanks {
			ok = true
			usage = max(usage, r.TokenUsage)
			if r.WaitingUncachedTokens != nil {
				backlog += int(*r.WaitingUncachedTokens)
			}
			age = min(age, time.Duration(r.AgeMs)*time.Millisecond)
		}
	}
	return usage, backlog, age, ok
}

// route routes prompt without tracking it and says "worker/reason".
func (d *demo) route(prompt []uint32) (string, gateway.Decision, error) {
	dec, err := d.gw.gw.Route(gateway.RouteRequest{Model: model, TokenIDs: prompt})
	if err != nil {
		return "", dec, err
	}
	return dec.Worker + "/" + string(dec.Reason), dec, nil
}

// hold stores prompt's first blocks on rank 0 of each worker given, and
// waits until the gateway has applied every batch (a route would record
// a placement, so the index is not probed by routing).
func (d *demo) hold(ctx context.Context, prompt []uint32, blocks map[*worker]int) error {
	for w, n := range blocks {
		if _, err := w.eng.Step(sim.Request{Rank: 0, Tokens: prompt[:n*blockSize]}); err != nil {
			return fmt.Errorf("%s: %w", w.id, err)
		}
	}
	if !d.waitFor(ctx, loadWait, d.caughtUp) {
		return fmt.Errorf("the gateway did not apply the prompt's blocks within %s", loadWait)
	}
	return nil
}

// drained waits until no engine reports load any more. Every rank
// publishes a batch every half second meanwhile: a stream's load_only
// heartbeats carry only its last batch's rank (SMG's rule), so a rank that
// went quiet keeps its last record until it publishes again.
func (d *demo) drained(ctx context.Context) error {
	next := time.Now()
	if !d.waitFor(ctx, loadWait, func() bool {
		if time.Now().After(next) {
			next = time.Now().Add(500 * time.Millisecond)
			if err := d.flush(); err != nil {
				return false
			}
		}
		for _, w := range d.workers {
			if u, b, _, _ := d.engineLoadOf(w); u > 0.05 || b > 0 {
				return false
			}
		}
		return true
	}) {
		return fmt.Errorf("the engines' load did not drain within %s", loadWait)
	}
	return nil
}

func (d *demo) runLoadChecks(ctx context.Context) {
	d.phase = "load"
	d.showProgress(d.prog.term)
	vllmW, sglangW, sglang2 := d.workers[0], d.workers[1], d.workers[2]
	checks := []struct {
		name string
		run  func(c *LoadCheck) error
	}{
		{"overlap decay", func(c *LoadCheck) error {
			// Decay compares the holders' backlogs, which SGLang reports
			// (/v1/loads) and vLLM's /metrics does not: two SGLang holders.
			prompt := loadPrompt(1, 8)
			if err := d.hold(ctx, prompt, map[*worker]int{sglangW: 8, sglang2: 6}); err != nil {
				return err
			}
			c.Want = sglang2.id + "/" + string(picker.ReasonHit)
			return d.underLoad(ctx, c, prompt, func() func() { return d.otherClient(1, 120, 40, 4*blockSize, sglangW) },
				func() (bool, string) {
					_, b, age, _ := d.engineLoadOf(sglangW)
					_, b2, _, ok2 := d.engineLoadOf(sglang2)
					return b >= 4096 && ok2, fmt.Sprintf("%s holds all 8 of the prompt's blocks, %s 6; %s's engine then got 120 requests at once and 160/s "+
						"from another client: its /v1/loads reports %d uncached tokens waiting, %s's %d (record %d ms old at the gateway), "+
						"so its 8 blocks count 8/(1+%.0f×%d/%d)", sglangW.id, sglang2.id, sglangW.id, b, sglang2.id, b2, age.Milliseconds(),
						overlapDecay, b-b2, len(prompt))
				})
		}},
		{"balance threshold", func(c *LoadCheck) error {
			prompt := loadPrompt(2, 8)
			if err := d.hold(ctx, prompt, map[*worker]int{sglangW: 8}); err != nil {
				return err
			}
			c.Want = "/" + string(picker.ReasonKVPressure)
			// 16 running requests of 432 uncached tokens hold 0.86 of a
			// rank's 8,192-token cache.
			return d.underLoad(ctx, c, prompt, func() func() { return d.otherClient(2, 100, 16, 432, vllmW) },
				func() (bool, string) {
					hot, _, age, _ := d.engineLoadOf(vllmW)
					cold, _, _, _ := d.engineLoadOf(sglangW)
					return hot-cold > balanceUsage && hot <= overloadUsage, fmt.Sprintf("%s's engine got 100 requests at once and 64/s from another client: "+
						"its /metrics says KV usage %.2f, %s's %.2f (record %d ms old): spread %.2f > balance threshold %.2f",
						vllmW.id, hot, sglangW.id, cold, age.Milliseconds(), hot-cold, balanceUsage)
				})
		}},
		{"overload threshold", func(c *LoadCheck) error {
			prompt := loadPrompt(3, 8)
			if err := d.hold(ctx, prompt, map[*worker]int{vllmW: 8}); err != nil {
				return err
			}
			c.Want = "/" + string(picker.ReasonKVPressure)
			return d.underLoad(ctx, c, prompt, func() func() { return d.otherClient(3, 160, 8, 640, vllmW, sglangW) },
				func() (bool, string) {
					a, _, age, _ := d.engineLoadOf(vllmW)
					b, _, _, _ := d.engineLoadOf(sglangW)
					return min(a, b) > overloadUsage, fmt.Sprintf("%s's and %s's engines each got 160 requests at once and 32/s from another client: KV usage %.2f and %.2f "+
						"(record %d ms old), spread under the balance threshold, hottest > overload threshold %.2f", vllmW.id, sglangW.id, a, b, age.Milliseconds(), overloadUsage)
				})
		}},
	}
	for _, ch := range checks {
		if ctx.Err() != nil {
			return
		}
		c := LoadCheck{Name: ch.name}
		if err := ch.run(&c); err != nil {
			c.Err = err.Error()
			c.Detail += " [" + err.Error() + "]"
		}
		d.report.Loads = append(d.report.Loads, c)
		d.prog.log("[%5.1fs] %-20s idle → %s, under load → %s: %s", time.Since(d.started).Seconds(), c.Name, c.Idle, c.Loaded, passFail(c.Pass()))
	}
}

// underLoad routes prompt idle, puts the load on, waits until the gateway
// sees it (seen), routes again, and waits for the load to drain. A want
// starting with "/" names the reason only.
func (d *demo) underLoad(ctx context.Context, c *LoadCheck, prompt []uint32, put func() (stop func()), seen func() (bool, string)) error {
	var err error
	if c.Idle, _, err = d.route(prompt); err != nil {
		return err
	}
	stop := put()
	stopped := false
	defer func() {
		if !stopped {
			stop()
		}
	}()
	var detail string
	if !d.waitFor(ctx, loadWait, func() bool {
		var ok bool
		ok, detail = seen()
		return ok
	}) {
		c.Detail = detail
		return fmt.Errorf("the gateway did not see the load within %s", loadWait)
	}
	loaded, dec, err := d.route(prompt)
	if err != nil {
		return err
	}
	c.Loaded = loaded
	if c.Want[0] == '/' {
		c.Want = dec.Worker + c.Want
	}
	c.Detail = fmt.Sprintf("%s → %s", detail, loaded)
	stop()
	stopped = true
	return d.drained(ctx)
}

func passFail(ok bool) string {
	if ok {
		return "as the policy says"
	}
	return "NOT as the policy says"
}

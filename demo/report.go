package demo

import (
	"fmt"
	"io"
	"strings"
	"text/tabwriter"
	"time"
	"unicode/utf8"
)

// progress is the live status line: rewritten in place on a terminal, a
// plain line every few seconds (and at each phase change) otherwise, so a
// log file or CI output stays readable.
type progress struct {
	w     io.Writer
	term  bool
	last  time.Time
	width int
}

func newProgress(w io.Writer, term bool) *progress { return &progress{w: w, term: term} }

func (p *progress) show(force bool, format string, args ...any) {
	if p.w == nil {
		return
	}
	every := 3 * time.Second
	if p.term {
		every = 100 * time.Millisecond
	}
	if !force && time.Since(p.last) < every {
		return
	}
	p.last = time.Now()
	line := fmt.Sprintf(format, args...)
	if !p.term {
		fmt.Fprintln(p.w, line)
		return
	}
	pad := ""
	if n := p.width - utf8.RuneCountInString(line); n > 0 {
		pad = strings.Repeat(" ", n)
	}
	p.width = utf8.RuneCountInString(line)
	fmt.Fprint(p.w, "\r"+line+pad)
}

// log prints a line that stays: on a terminal it replaces the live line,
// which the next show redraws below it.
func (p *progress) log(format string, args ...any) {
	if p.w == nil {
		return
	}
	line := fmt.Sprintf(format, args...)
	if p.term {
		pad := ""
		if n := p.width - utf8.RuneCountInString(line); n > 0 {
			pad = strings.Repeat(" ", n)
		}
		p.width = 0
		fmt.Fprint(p.w, "\r"+line+pad+"\n")
		return
	}
	fmt.Fprintln(p.w, line)
}

// finish ends the rewritten line so the table starts on its own.
func (p *progress) finish() {
	if p.w != nil && p.term && p.width > 0 {
		fmt.Fprint(p.w, "\r"+strings.Repeat(" ", p.width)+"\r")
		p.width = 0
	}
}

func (d *demo) showProgress(force bool) {
	if d.prog.w == nil {
		return
	}
	var relayed uint64
	for _, w := range d.workers {
		relayed += readRelayCounters(w.regs).Relayed
	}
	// Kept under 80 columns: a rewritten line that wraps cannot be rewritten.
	head := fmt.Sprintf("[%5.1fs] %-20s", time.Since(d.started).Seconds(), d.phase)
	if n := len(d.report.Checks); n > 0 {
		exact := 0
		for _, c := range d.report.Checks {
			if c.Exact() {
				exact++
			}
		}
		d.prog.show(force, "%s checks done %d, exact %d   batches relayed %d", head, n, exact, relayed)
		return
	}
	d.prog.show(force, "%s req %5d  hit kvrelay %5.1f%% rr %5.1f%%  relayed %d",
		head, d.arms[0].Requests, 100*d.arms[0].HitRate(), 100*d.arms[1].HitRate(), relayed)
}

func yesNo(b bool) string {
	if b {
		return "yes"
	}
	return "NO"
}

// WriteTable prints the final table.
func (r *Report) WriteTable(w io.Writer) {
	fmt.Fprintf(w, "kvrelay demo: %d engines × %d DP ranks (%s), seed %d, %d requests compared, %.1f s\n\n",
		len(r.Workers), dpSize, strings.Join(r.Workers, ", "), r.Seed, r.KVRelay.Requests, r.Elapsed.Seconds())

	fmt.Fprintln(w, "Prefix-cache hits on the same request sequence (each policy on its own, initially empty, identical engines):")
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	head := "routing\trequests\tprompt blocks\tserved from cache\thit rate\tprefill tokens saved\tprefill tokens computed\t"
	for _, id := range r.Workers {
		head += "→ " + id + "\t"
	}
	fmt.Fprintln(tw, head)
	for _, a := range []ArmResult{r.KVRelay, r.RoundRobin} {
		name := a.Policy
		if name == "kvrelay" {
			name = "kvrelay (cache-aware)"
		}
		row := fmt.Sprintf("%s\t%d\t%d\t%d\t%.1f%%\t%d\t%d\t", name, a.Requests, a.PromptBlocks, a.HitBlocks, 100*a.HitRate(), a.SavedTokens(), a.PrefillTokens())
		for _, n := range a.PerWorker {
			row += fmt.Sprintf("%d\t", n)
		}
		fmt.Fprintln(tw, row)
	}
	tw.Flush()
	fmt.Fprintf(w, "kvrelay routing: %+.1f points, %d more blocks served from cache instead of prefilled: %d fewer prefill tokens%s.\n",
		100*(r.KVRelay.HitRate()-r.RoundRobin.HitRate()), r.KVRelay.HitBlocks-r.RoundRobin.HitBlocks,
		r.RoundRobin.PrefillTokens()-r.KVRelay.PrefillTokens(), prefillShare(r.KVRelay, r.RoundRobin))
	fmt.Fprintf(w, "Gateway decisions: %d on a cached prefix (event_hit), %d spilled to a less loaded engine (event_spill), %d with no engine holding the prefix (no_overlap).\n",
		r.Decisions["event_hit"], r.Decisions["event_spill"], r.Decisions["no_overlap"])
	fmt.Fprintf(w, "(Both policies place a chat on DP rank session mod %d inside an engine; a request stays in flight %d steps of %s;\n"+
		" each rank caches %d blocks of %d tokens.)\n\n", dpSize, decodeSteps, stepInterval, capacityBlocks, blockSize)

	fmt.Fprintln(w, "Routing on the engines' load, read by each relay from its engine's HTTP server and carried on its stream:")
	for _, c := range r.Loads {
		fmt.Fprintf(w, "  %-19s idle → %s; loaded → %s (%s)\n    %s\n", c.Name+":", c.Idle, c.Loaded, passFail(c.Pass()), c.Detail)
	}
	fmt.Fprintf(w, "(gateway: --overlap-decay %g --overload-token-usage-threshold %g --balance-token-usage-threshold %g)\n\n", overlapDecay, overloadUsage, balanceUsage)

	fmt.Fprintln(w, "Relays (their Prometheus counters, summed over relay restarts):")
	tw = tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	head = "\t"
	for _, rt := range r.Relays {
		head += rt.Worker + "\t"
	}
	fmt.Fprintln(tw, head)
	rows := []struct {
		name string
		get  func(RelayCounters) uint64
	}{
		{"batches relayed", func(c RelayCounters) uint64 { return c.Relayed }},
		{"live gaps seen", func(c RelayCounters) uint64 { return c.Gaps }},
		{"batches recovered by replay", func(c RelayCounters) uint64 { return c.Recovered }},
		{"replays cut short, resumed", func(c RelayCounters) uint64 { return c.ReplaysTrunc }},
		{"batches lost (holes)", func(c RelayCounters) uint64 { return c.Lost }},
		{"publisher restarts detected", func(c RelayCounters) uint64 { return c.Restarts }},
		{"snapshots served", func(c RelayCounters) uint64 { return c.Snapshots }},
		{"subscriptions served from history", func(c RelayCounters) uint64 { return c.HistoryResumes }},
		{"relay starts", func(c RelayCounters) uint64 { return uint64(c.RelayStarts) }},
	}
	for _, row := range rows {
		line := row.name + "\t"
		for _, rt := range r.Relays {
			line += fmt.Sprintf("%d\t", row.get(rt.RelayCounters))
		}
		fmt.Fprintln(tw, line)
	}
	tw.Flush()
	fmt.Fprintln(w)

	fmt.Fprintln(w, "Gateway index vs the engines' true live sets, after each fault once the gateway caught up")
	fmt.Fprintln(w, "(rows = DP rank × tier × block with copy counts; index rows / engine rows):")
	tw = tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	head = "check\texact\t"
	for _, id := range r.Workers {
		head += id + "\t"
	}
	fmt.Fprintln(tw, head+"caught up in\t")
	for _, c := range r.Checks {
		line := fmt.Sprintf("%s\t%s\t", c.Name, yesNo(c.Exact()))
		for _, wc := range c.Workers {
			cell := fmt.Sprintf("%d/%d", wc.IndexRows, wc.EngineRows)
			if !wc.Exact() {
				cell += fmt.Sprintf(" (-%d +%d ~%d)", wc.Missing, wc.Extra, wc.WrongCopies)
			}
			line += cell + "\t"
		}
		settle := fmt.Sprintf("%.2f s", c.Settle.Seconds())
		if !c.Quiescent {
			settle = "timed out"
		}
		if c.Refreshes > 0 {
			settle += fmt.Sprintf(" (%d refresh)", c.Refreshes)
		}
		fmt.Fprintln(tw, line+settle+"\t")
	}
	tw.Flush()
	fmt.Fprintln(w)
	for _, c := range r.Checks {
		fmt.Fprintf(w, "  %-21s %s\n", c.Name+":", c.Detail)
	}
	fmt.Fprintln(w)

	exact := 0
	for _, c := range r.Checks {
		if c.Exact() {
			exact++
		}
	}
	verdict := "PASS"
	if !r.OK() {
		verdict = "FAIL"
	}
	loads := 0
	for _, c := range r.Loads {
		if c.Pass() {
			loads++
		}
	}
	fmt.Fprintf(w, "%s: index exact after %d of %d checks; routing on load as the policy says in %d of %d; kvrelay hit rate %.1f%% vs round-robin %.1f%%\n",
		verdict, exact, len(r.Checks), loads, len(r.Loads), 100*r.KVRelay.HitRate(), 100*r.RoundRobin.HitRate())
}

// prefillShare says how much of round-robin's prefill work the kvrelay arm
// left to do.
func prefillShare(kv, rr ArmResult) string {
	if rr.PrefillTokens() == 0 {
		return ""
	}
	return fmt.Sprintf(" (%.0f%% of round-robin's prefill work)", 100*float64(kv.PrefillTokens())/float64(rr.PrefillTokens()))
}

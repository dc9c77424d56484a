package fleetsim

import (
	"fmt"
	"math/rand/v2"

	"github.com/kvrelay/kvrelay/sim/workload"
)

// Arrival is one request of a trace.
type Arrival struct {
	// At is the arrival time in seconds from the trace's start.
	At     float64
	Tokens []uint32
}

// Trace is a named request sequence every policy replays.
type Trace struct {
	Name     string
	Arrivals []Arrival
}

// ChatConfig shapes the multi-turn chat trace.
type ChatConfig struct {
	Seed     uint64
	Requests int
	// Rate is the mean arrival rate (requests/s, Poisson).
	Rate float64
	// Chat sessions as sim/workload makes them.
	Workload workload.Config
}

// Chat builds a multi-turn chat trace: sessions over shared system prompts,
// one turn per arrival, Poisson arrivals.
func Chat(cfg ChatConfig) (Trace, error) {
	if cfg.Requests <= 0 || !(cfg.Rate > 0) {
		return Trace{}, fmt.Errorf("fleetsim: chat trace needs requests > 0 and rate > 0, got %d and %v", cfg.Requests, cfg.Rate)
	}
	wc := cfg.Workload
	wc.Seed = cfg.Seed
	gen, err := workload.New(wc)
	if err != nil {
		return Trace{}, fmt.Errorf("fleetsim: chat trace: %w", err)
	}
	rng := rand.New(rand.NewPCG(cfg.Seed, 1))
	tr := Trace{Name: "chat", Arrivals: make([]Arrival, 0, cfg.Requests)}
	at := 0.0
	for range cfg.Requests {
		at += rng.ExpFloat64() / cfg.Rate
		tr.Arrivals = append(tr.Arrivals, Arrival{At: at, Tokens: gen.Next().Tokens})
	}
	return tr, nil
}

// AgenticConfig shapes the agentic trace.
type AgenticConfig struct {
	Seed     uint64
	Requests int
	// Rate is the mean request rate (requests/s); steps arrive as a
	// Poisson process at Rate ÷ the mean fan-out, each step's requests
	// together.
	Rate float64
	// Contexts long shared prefixes (a repository, a tool catalogue) of
	// ContextTokens each; every task works in one.
	Contexts, ContextTokens int
	// Tasks are active at once; each lasts Steps steps, and each step adds
	// StepTokens of tool output to the task's history.
	Tasks, Steps, StepTokens int
	// MaxFanout bounds a step's parallel sub-requests (uniform in
	// 1..MaxFanout); each adds SubTokens of its own after the history.
	MaxFanout, SubTokens int
	Vocab                int
}

// Agentic builds the agentic trace: long shared contexts, growing task
// histories, and bursts of parallel sub-requests.
func Agentic(cfg AgenticConfig) (Trace, error) {
	for name, v := range map[string]int{
		"requests": cfg.Requests, "contexts": cfg.Contexts, "context tokens": cfg.ContextTokens, "tasks": cfg.Tasks,
		"steps": cfg.Steps, "step tokens": cfg.StepTokens, "max fan-out": cfg.MaxFanout, "sub tokens": cfg.SubTokens, "vocab": cfg.Vocab,
	} {
		if v <= 0 {
			return Trace{}, fmt.Errorf("fleetsim: agentic trace: %s must be positive, got %d", name, v)
		}
	}
	if !(cfg.Rate > 0) {
		return Trace{}, fmt.Errorf("fleetsim: agentic trace: rate must be positive, got %v", cfg.Rate)
	}
	rng := rand.New(rand.NewPCG(cfg.Seed, 2))
	toks := func(n int) []uint32 {
		out := make([]uint32, n)
		for i := range out {
			out[i] = uint32(rng.IntN(cfg.Vocab))
		}
		return out
	}
	contexts := make([][]uint32, cfg.Contexts)
	for i := range contexts {
		contexts[i] = toks(cfg.ContextTokens)
	}
	type task struct {
		history []uint32
		step    int
	}
	newTask := func() *task {
		return &task{history: append([]uint32(nil), contexts[rng.IntN(cfg.Contexts)]...)}
	}
	tasks := make([]*task, cfg.Tasks)
	for i := range tasks {
		tasks[i] = newTask()
	}
	stepRate := cfg.Rate / (float64(cfg.MaxFanout+1) / 2)
	tr := Trace{Name: "agentic", Arrivals: make([]Arrival, 0, cfg.Requests)}
	at := 0.0
	for len(tr.Arrivals) < cfg.Requests {
		at += rng.ExpFloat64() / stepRate
		i := rng.IntN(len(tasks))
		tk := tasks[i]
		for range 1 + rng.IntN(cfg.MaxFanout) {
			if len(tr.Arrivals) == cfg.Requests {
				break
			}
			p := make([]uint32, 0, len(tk.history)+cfg.SubTokens)
			p = append(append(p, tk.history...), toks(cfg.SubTokens)...)
			tr.Arrivals = append(tr.Arrivals, Arrival{At: at, Tokens: p})
		}
		tk.history = append(tk.history, toks(cfg.StepTokens)...)
		if tk.step++; tk.step >= cfg.Steps {
			tasks[i] = newTask()
		}
	}
	return tr, nil
}

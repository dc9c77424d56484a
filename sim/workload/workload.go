// Package workload generates the simulator's traffic: multi-turn chat
// sessions over a few shared system prompts, so requests share long prefixes
// (the system prompt across sessions, the history within a session) the way
// real chat traffic does. It is deterministic under its seed.
package workload

import (
	"fmt"
	"math/rand/v2"
)

// Config shapes the traffic. Zero fields take the defaults in Defaults.
type Config struct {
	Seed uint64
	// SystemPrompts is how many distinct system prompts sessions share.
	SystemPrompts int
	// SystemPromptTokens is each system prompt's length.
	SystemPromptTokens int
	// Sessions is how many chats are active at once; a finished chat is
	// replaced by a new one.
	Sessions int
	// Turns is each chat's length in requests.
	Turns int
	// TokensPerTurn is what one turn (user message plus the previous
	// answer) adds to the conversation.
	TokensPerTurn int
	// Vocab bounds token ids to [0, Vocab).
	Vocab int
}

// Defaults are the values zero Config fields take.
var Defaults = Config{
	SystemPrompts:      4,
	SystemPromptTokens: 256,
	Sessions:           16,
	Turns:              4,
	TokensPerTurn:      64,
	Vocab:              32000,
}

// Request is one prompt: the session's system prompt plus its history.
type Request struct {
	// Session identifies the chat; ids are unique over a generator's life.
	Session int
	// Turn counts from 0 within the session.
	Turn int
	// SystemPrompt is the index of the shared system prompt.
	SystemPrompt int
	// Tokens is the whole prompt; the caller owns it.
	Tokens []uint32
}

type session struct {
	id, prompt, turn int
	history          []uint32
}

// Generator produces requests. It is not safe for concurrent use.
type Generator struct {
	cfg      Config
	rng      *rand.Rand
	prompts  [][]uint32
	active   []*session
	nextID   int
	produced int
}

// New checks cfg and builds the shared system prompts.
func New(cfg Config) (*Generator, error) {
	def := func(v *int, d int, name string) error {
		if *v == 0 {
			*v = d
		}
		if *v < 0 {
			return fmt.Errorf("workload: %s %d: must be positive", name, *v)
		}
		return nil
	}
	for _, f := range []struct {
		v    *int
		d    int
		name string
	}{
		{&cfg.SystemPrompts, Defaults.SystemPrompts, "system prompts"},
		{&cfg.SystemPromptTokens, Defaults.SystemPromptTokens, "system prompt tokens"},
		{&cfg.Sessions, Defaults.Sessions, "sessions"},
		{&cfg.Turns, Defaults.Turns, "turns"},
		{&cfg.TokensPerTurn, Defaults.TokensPerTurn, "tokens per turn"},
		{&cfg.Vocab, Defaults.Vocab, "vocabulary size"},
	} {
		if err := def(f.v, f.d, f.name); err != nil {
			return nil, err
		}
	}
	g := &Generator{cfg: cfg, rng: rand.New(rand.NewPCG(cfg.Seed, 0x6b7672656c6179))}
	g.prompts = make([][]uint32, cfg.SystemPrompts)
	for i := range g.prompts {
		g.prompts[i] = g.tokens(cfg.SystemPromptTokens)
	}
	g.active = make([]*session, cfg.Sessions)
	for i := range g.active {
		g.active[i] = g.newSession()
	}
	return g, nil
}

// Config is the effective configuration, defaults applied.
func (g *Generator) Config() Config { return g.cfg }

func (g *Generator) tokens(n int) []uint32 {
	out := make([]uint32, n)
	for i := range out {
		out[i] = uint32(g.rng.IntN(g.cfg.Vocab))
	}
	return out
}

func (g *Generator) newSession() *session {
	s := &session{id: g.nextID, prompt: g.rng.IntN(g.cfg.SystemPrompts)}
	g.nextID++
	s.history = append(s.history, g.prompts[s.prompt]...)
	return s
}

// Next advances a random active chat by one turn and returns its prompt.
func (g *Generator) Next() Request {
	i := g.rng.IntN(len(g.active))
	s := g.active[i]
	s.history = append(s.history, g.tokens(g.cfg.TokensPerTurn)...)
	req := Request{Session: s.id, Turn: s.turn, SystemPrompt: s.prompt, Tokens: append([]uint32(nil), s.history...)}
	s.turn++
	if s.turn >= g.cfg.Turns {
		g.active[i] = g.newSession()
	}
	g.produced++
	return req
}

// Produced counts the requests Next has returned.
func (g *Generator) Produced() int { return g.produced }

package workload

import (
	"slices"
	"testing"
)

func TestDeterministicUnderSeed(t *testing.T) {
	a, _ := New(Config{Seed: 3})
	b, _ := New(Config{Seed: 3})
	c, _ := New(Config{Seed: 4})
	same := true
	for i := 0; i < 50; i++ {
		ra, rb, rc := a.Next(), b.Next(), c.Next()
		if !slices.Equal(ra.Tokens, rb.Tokens) || ra.Session != rb.Session {
			t.Fatalf("request %d differs under one seed", i)
		}
		same = same && slices.Equal(ra.Tokens, rc.Tokens)
	}
	if same {
		t.Fatal("different seeds gave the same traffic")
	}
}

func TestChatsGrowAndShareSystemPrompts(t *testing.T) {
	cfg := Config{Seed: 1, SystemPrompts: 2, SystemPromptTokens: 10, Sessions: 3, Turns: 3, TokensPerTurn: 5, Vocab: 100}
	g, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	last := map[int]Request{}
	sys := map[int][]uint32{}
	for i := 0; i < 200; i++ {
		r := g.Next()
		if want := 10 + 5*(r.Turn+1); len(r.Tokens) != want {
			t.Fatalf("turn %d has %d tokens, want %d", r.Turn, len(r.Tokens), want)
		}
		if r.Turn >= 3 {
			t.Fatalf("turn %d past the chat's length", r.Turn)
		}
		for _, tok := range r.Tokens {
			if tok >= 100 {
				t.Fatalf("token %d outside the vocabulary", tok)
			}
		}
		if p, ok := last[r.Session]; ok {
			if r.Turn != p.Turn+1 || !slices.Equal(r.Tokens[:len(p.Tokens)], p.Tokens) {
				t.Fatalf("session %d turn %d does not extend its history", r.Session, r.Turn)
			}
		} else if r.Turn != 0 {
			t.Fatalf("session %d starts at turn %d", r.Session, r.Turn)
		}
		last[r.Session] = r
		if s, ok := sys[r.SystemPrompt]; ok && !slices.Equal(s, r.Tokens[:10]) {
			t.Fatalf("system prompt %d changed", r.SystemPrompt)
		}
		sys[r.SystemPrompt] = r.Tokens[:10]
	}
	if len(last) <= 3 {
		t.Fatalf("only %d sessions in 200 requests: finished chats are not replaced", len(last))
	}
	if g.Produced() != 200 {
		t.Fatalf("produced %d", g.Produced())
	}
}

func TestRejectsNegative(t *testing.T) {
	if _, err := New(Config{Sessions: -1}); err == nil {
		t.Fatal("negative sessions accepted")
	}
}

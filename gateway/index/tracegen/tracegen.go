// Package tracegen produces request workloads for replaying against the
// prefix index: a seeded synthetic generator (sessions × turns over a pool
// of shared prefixes) and a reader for Mooncake-format JSONL traces whose
// hash ids it expands into token blocks, in the manner of Dynamo's
// mooncake_bench (length and duplication factors).
package tracegen

import (
	"bufio"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"slices"
)

// Request is one request of a workload, in arrival order.
type Request struct {
	// Session groups a conversation's turns (the record index for traces).
	Session int
	// TimestampMs is the arrival time, if the source has one.
	TimestampMs int64
	Tokens      []uint32
}

// SyntheticConfig shapes a synthetic workload. Every session starts with one
// of PrefixPool shared prefixes (a system prompt) of PrefixBlocks blocks;
// each turn appends TurnBlocks new blocks to the conversation, and a turn's
// request is the whole conversation so far.
type SyntheticConfig struct {
	Seed         uint64
	Sessions     int
	Turns        int
	PrefixPool   int
	PrefixBlocks int
	TurnBlocks   int
	BlockSize    int
}

// Validate reports a configuration that cannot produce a workload.
func (c SyntheticConfig) Validate() error {
	if c.Sessions <= 0 || c.Turns <= 0 || c.PrefixPool <= 0 || c.BlockSize <= 0 || c.PrefixBlocks < 0 || c.TurnBlocks <= 0 {
		return fmt.Errorf("tracegen: invalid synthetic config %+v", c)
	}
	return nil
}

// Synthetic generates the workload: turn t of every session, sessions in a
// seeded random order per turn, so conversations interleave as on a gateway.
func Synthetic(c SyntheticConfig) ([]Request, error) {
	if err := c.Validate(); err != nil {
		return nil, err
	}
	rng := rand.New(rand.NewPCG(c.Seed, 0x5eed))
	prefixes := make([][]uint32, c.PrefixPool)
	for i := range prefixes {
		prefixes[i] = randomTokens(rng, c.PrefixBlocks*c.BlockSize)
	}
	convs := make([][]uint32, c.Sessions)
	for s := range convs {
		convs[s] = slices.Clone(prefixes[rng.IntN(c.PrefixPool)])
	}
	order := make([]int, c.Sessions)
	for i := range order {
		order[i] = i
	}
	out := make([]Request, 0, c.Sessions*c.Turns)
	for range c.Turns {
		rng.Shuffle(len(order), func(i, j int) { order[i], order[j] = order[j], order[i] })
		for _, s := range order {
			convs[s] = append(convs[s], randomTokens(rng, c.TurnBlocks*c.BlockSize)...)
			out = append(out, Request{Session: s, Tokens: convs[s][:len(convs[s]):len(convs[s])]})
		}
	}
	return out, nil
}

func randomTokens(rng *rand.Rand, n int) []uint32 {
	t := make([]uint32, n)
	for i := range t {
		t[i] = rng.Uint32N(128_000) // a vocabulary-sized range
	}
	return t
}

// MooncakeRecord is one line of a Mooncake trace. Each hash id names one
// 512-token block of the original prompt; equal ids are shared prefixes.
type MooncakeRecord struct {
	Timestamp    int64    `json:"timestamp"`
	InputLength  int      `json:"input_length"`
	OutputLength int      `json:"output_length"`
	HashIDs      []uint64 `json:"hash_ids"`
}

// Limits keep a malformed or hostile trace from exhausting memory.
const (
	maxLineBytes  = 4 << 20
	maxHashIDs    = 1 << 16
	maxExpandedTk = 1 << 22
)

// ReadMooncake parses a JSONL trace. Blank lines are skipped; any other
// line that is not a record is an error naming its line number.
func ReadMooncake(r io.Reader) ([]MooncakeRecord, error) {
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 64<<10), maxLineBytes)
	var out []MooncakeRecord
	for line := 1; sc.Scan(); line++ {
		b := sc.Bytes()
		if len(trimSpace(b)) == 0 {
			continue
		}
		var rec MooncakeRecord
		if err := json.Unmarshal(b, &rec); err != nil {
			return nil, fmt.Errorf("tracegen: mooncake line %d: %w", line, err)
		}
		if len(rec.HashIDs) > maxHashIDs {
			return nil, fmt.Errorf("tracegen: mooncake line %d: %d hash ids, limit %d", line, len(rec.HashIDs), maxHashIDs)
		}
		if rec.InputLength < 0 || rec.OutputLength < 0 {
			return nil, fmt.Errorf("tracegen: mooncake line %d: negative length", line)
		}
		out = append(out, rec)
	}
	if err := sc.Err(); err != nil {
		if errors.Is(err, bufio.ErrTooLong) {
			return nil, fmt.Errorf("tracegen: mooncake line longer than %d bytes: %w", maxLineBytes, err)
		}
		return nil, fmt.Errorf("tracegen: reading mooncake trace: %w", err)
	}
	return out, nil
}

func trimSpace(b []byte) []byte {
	for len(b) > 0 && (b[0] == ' ' || b[0] == '\t' || b[0] == '\r') {
		b = b[1:]
	}
	for len(b) > 0 && (b[len(b)-1] == ' ' || b[len(b)-1] == '\t' || b[len(b)-1] == '\r') {
		b = b[:len(b)-1]
	}
	return b
}

// ExpandConfig turns trace records into token requests.
type ExpandConfig struct {
	// BlockSize is the tokens per index block.
	BlockSize int
	// LengthFactor expands each hash id into this many blocks (≥ 1).
	LengthFactor int
	// Duplication replays the trace this many times (≥ 1) over disjoint id
	// spaces, interleaved by timestamp, multiplying the distinct prefixes.
	Duplication int
}

// ExpandMooncake maps every hash id to LengthFactor blocks of deterministic
// tokens (equal ids give equal blocks, so shared prefixes stay shared).
func ExpandMooncake(recs []MooncakeRecord, c ExpandConfig) ([]Request, error) {
	if c.BlockSize <= 0 || c.LengthFactor <= 0 || c.Duplication <= 0 {
		return nil, fmt.Errorf("tracegen: invalid expand config %+v", c)
	}
	out := make([]Request, 0, len(recs)*c.Duplication)
	for i, rec := range recs {
		n := len(rec.HashIDs) * c.LengthFactor * c.BlockSize
		if n > maxExpandedTk {
			return nil, fmt.Errorf("tracegen: record %d expands to %d tokens, limit %d", i, n, maxExpandedTk)
		}
		for d := range c.Duplication {
			toks := make([]uint32, 0, n)
			for _, id := range rec.HashIDs {
				for j := range c.LengthFactor {
					base := splitmix(id ^ uint64(d)<<48 ^ uint64(j)<<56)
					for k := range c.BlockSize {
						toks = append(toks, uint32(base>>32)^uint32(k)*0x9E3779B9)
					}
				}
			}
			out = append(out, Request{Session: i, TimestampMs: rec.Timestamp, Tokens: toks})
		}
	}
	slices.SortStableFunc(out, func(a, b Request) int {
		switch {
		case a.TimestampMs < b.TimestampMs:
			return -1
		case a.TimestampMs > b.TimestampMs:
			return 1
		}
		return 0
	})
	return out, nil
}

func splitmix(x uint64) uint64 {
	x += 0x9E3779B97F4A7C15
	x = (x ^ x>>30) * 0xBF58476D1CE4E5B9
	x = (x ^ x>>27) * 0x94D049BB133111EB
	return x ^ x>>31
}

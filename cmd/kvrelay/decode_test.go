package main

import (
	"bytes"
	"context"
	"encoding/hex"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// Payloads encoded by msgspec 0.23 (TokenSpeed's shapes, engine-wire.md §3.5).
const (
	// [1.5, [["BlockStored",[123],None,[1,2],2], ["BlockRemoved",[123]]], 2]
	tsBatchHex = "93cb3ff80000000000009295ab426c6f636b53746f726564917bc09201020292ac426c6f636b52656d6f766564917b02"
	// [2.5, [["BlockStored",[124],123,[3,4],2]], 2]: a child of the block above.
	tsChildHex = "93cb40040000000000009195ab426c6f636b53746f726564917c7b9203040202"
	// [1.5, [["Nope"]], 0]: an unknown event tag.
	unknownTagHex = "93cb3ff80000000000009191a44e6f706500"
	// [1.5, 7, 0]: events is not an array.
	notABatchHex = "93cb3ff80000000000000700"
)

const (
	tsBatchJSON = `{"batch":{"sequenceNumber":"5","timestamp":1.5,"events":[` +
		`{"eventId":"1","stored":{"blocks":[{"blockHash":"123","tokenIds":[1,2],"blockSize":2}],"tier":"KV_CACHE_TIER_DEVICE","locality":"KV_CACHE_LOCALITY_LOCAL"}},` +
		`{"eventId":"2","removed":{"blockHashes":["123"],"tier":"KV_CACHE_TIER_DEVICE","locality":"KV_CACHE_LOCALITY_LOCAL"}}` +
		`],"dpRank":2},"drops":{}}` + "\n"
	tsBatchSeq0Rank7JSON = `{"batch":{"timestamp":1.5,"events":[` +
		`{"eventId":"1","stored":{"blocks":[{"blockHash":"123","tokenIds":[1,2],"blockSize":2}],"tier":"KV_CACHE_TIER_DEVICE","locality":"KV_CACHE_LOCALITY_LOCAL"}},` +
		`{"eventId":"2","removed":{"blockHashes":["123"],"tier":"KV_CACHE_TIER_DEVICE","locality":"KV_CACHE_LOCALITY_LOCAL"}}` +
		`],"dpRank":7},"drops":{}}` + "\n"
	unknownTagSeq6JSON = `{"batch":{"sequenceNumber":"6","timestamp":1.5,"dpRank":0},"drops":{"unknown_type":1}}` + "\n"
	// The removal of the first line's store consumed ids 1 and 2, so the
	// child on the next line is id 3: one normalizer for the whole input.
	tsChildSeq1JSON = `{"batch":{"sequenceNumber":"1","timestamp":2.5,"events":[` +
		`{"eventId":"3","stored":{"blocks":[{"blockHash":"124","tokenIds":[3,4],"blockSize":2}],"parentBlockHash":"123","tier":"KV_CACHE_TIER_DEVICE","locality":"KV_CACHE_LOCALITY_LOCAL"}}` +
		`],"dpRank":2},"drops":{}}` + "\n"
)

func mustHex(t *testing.T, s string) []byte {
	t.Helper()
	b, err := hex.DecodeString(s)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func TestDecode(t *testing.T) {
	dir := t.TempDir()
	rawFile := filepath.Join(dir, "batch.msgpack")
	if err := os.WriteFile(rawFile, mustHex(t, tsBatchHex), 0o600); err != nil {
		t.Fatal(err)
	}
	truncatedFile := filepath.Join(dir, "truncated.msgpack")
	if err := os.WriteFile(truncatedFile, mustHex(t, tsBatchHex[:len(tsBatchHex)-8]), 0o600); err != nil {
		t.Fatal(err)
	}

	tests := []struct {
		name  string
		args  []string
		stdin string
		code  int
		out   string
		// errOut is the exact stderr; errPrefix and errAt are used instead
		// for messages whose tail the wire decoder words.
		errOut    string
		errPrefix string
		errAt     string
	}{
		{
			name:  "good hex",
			args:  []string{"--engine", "tokenspeed", "--hex", "--seq", "5"},
			stdin: tsBatchHex + "\n\n   \n" + unknownTagHex + "\n",
			code:  0,
			out:   tsBatchJSON + unknownTagSeq6JSON,
		},
		{
			name:  "hex lines share one normalizer",
			args:  []string{"--engine=tokenspeed", "--hex"},
			stdin: tsBatchHex + "\r\n" + tsChildHex, // CRLF, and no final newline
			code:  0,
			out:   strings.Replace(tsBatchJSON, `"sequenceNumber":"5",`, ``, 1) + tsChildSeq1JSON,
		},
		{
			name: "raw file with socket rank",
			args: []string{"--engine", "vllm", "--rank", "7", rawFile},
			code: 0,
			out:  tsBatchSeq0Rank7JSON,
		},
		{
			name:  "raw stdin",
			args:  []string{"--engine", "sglang", "--seq", "5", "-"},
			stdin: string(mustHex(t, tsBatchHex)),
			code:  0,
			out:   tsBatchJSON,
		},
		{
			name:   "bad hex digit",
			args:   []string{"--engine", "vllm", "--hex"},
			stdin:  tsBatchHex + "\n93cb3fz8\n",
			code:   2,
			out:    strings.Replace(tsBatchJSON, `"sequenceNumber":"5",`, ``, 1),
			errOut: "kvrelay decode: line 2: bad hex at byte 6: 'z' is not a hex digit\n",
		},
		{
			name:   "odd hex length",
			args:   []string{"--engine", "vllm", "--hex"},
			stdin:  "\n93c\n",
			code:   2,
			errOut: "kvrelay decode: line 2: bad hex at byte 3: odd number of hex digits (3)\n",
		},
		{
			name:      "truncated hex payload",
			args:      []string{"--engine", "sglang", "--hex"},
			stdin:     tsBatchHex[:len(tsBatchHex)-8] + "\n",
			code:      2,
			errPrefix: "kvrelay decode: line 1: undecodable KV event batch: at byte ",
			errAt:     "at byte 32:",
		},
		{
			name:      "truncated raw file",
			args:      []string{"--engine", "sglang", truncatedFile},
			code:      2,
			errPrefix: "kvrelay decode: " + truncatedFile + ": undecodable KV event batch: at byte ",
			errAt:     "at byte 32:",
		},
		{
			name:      "not a batch",
			args:      []string{"--engine", "vllm", "--hex", "--seq", "5"},
			stdin:     tsBatchHex + "\n" + notABatchHex + "\n" + tsBatchHex + "\n",
			code:      2,
			out:       tsBatchJSON,
			errPrefix: "kvrelay decode: line 2: undecodable KV event batch: at byte ",
			errAt:     "at byte 10:",
		},
		{
			name:   "unknown engine",
			args:   []string{"--engine", "trtllm", "--hex"},
			stdin:  tsBatchHex,
			code:   2,
			errOut: "kvrelay decode: --engine \"trtllm\": want vllm, sglang or tokenspeed\n",
		},
		{
			name:   "missing engine",
			args:   []string{"--hex"},
			code:   2,
			errOut: "kvrelay decode: --engine is required: vllm, sglang or tokenspeed\n",
		},
		{
			name:   "rank out of range",
			args:   []string{"--engine", "vllm", "--rank", "-2"},
			code:   2,
			errOut: "kvrelay decode: --rank -2: want -1 or a rank from 0 to 2147483647\n",
		},
		{
			name:   "bad seq value",
			args:   []string{"--engine", "vllm", "--seq", "-1"},
			code:   2,
			errOut: "kvrelay decode: invalid value \"-1\" for flag -seq: parse error\nrun 'kvrelay decode --help' for usage\n",
		},
		{
			name:   "undefined flag",
			args:   []string{"--engine", "vllm", "--bogus"},
			code:   2,
			errOut: "kvrelay decode: flag provided but not defined: -bogus\nrun 'kvrelay decode --help' for usage\n",
		},
		{
			name:   "two files",
			args:   []string{"--engine", "vllm", "a", "b"},
			code:   2,
			errOut: "kvrelay decode: one FILE at most, got 2: a b\n",
		},
		{
			name:      "missing file",
			args:      []string{"--engine", "vllm", filepath.Join(dir, "absent")},
			code:      2,
			errPrefix: "kvrelay decode: open " + filepath.Join(dir, "absent") + ": ",
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			var stdout, stderr bytes.Buffer
			code := dispatch(context.Background(), append([]string{"decode"}, tc.args...),
				strings.NewReader(tc.stdin), &stdout, &stderr)
			if code != tc.code {
				t.Errorf("exit code %d, want %d (stderr %q)", code, tc.code, stderr.String())
			}
			if got := stdout.String(); got != tc.out {
				t.Errorf("stdout:\n%s\nwant:\n%s", got, tc.out)
			}
			errText := stderr.String()
			switch {
			case tc.errOut != "" || (tc.errPrefix == "" && tc.code == 0):
				if errText != tc.errOut {
					t.Errorf("stderr %q, want %q", errText, tc.errOut)
				}
			default:
				if !strings.HasPrefix(errText, tc.errPrefix) {
					t.Errorf("stderr %q, want prefix %q", errText, tc.errPrefix)
				}
				if !strings.Contains(errText, tc.errAt) {
					t.Errorf("stderr %q does not name %q", errText, tc.errAt)
				}
			}
			if tc.code == 2 && tc.errPrefix != "" && strings.HasPrefix(tc.errPrefix, "kvrelay decode:") {
				if strings.Count(errText, "\n") != 1 || !strings.HasSuffix(errText, "\n") {
					t.Errorf("stderr is not one line: %q", errText)
				}
			}
		})
	}
}

func TestDecodeHelpExitsZero(t *testing.T) {
	var stdout, stderr bytes.Buffer
	code := dispatch(context.Background(), []string{"decode", "-h"}, strings.NewReader(""), &stdout, &stderr)
	if code != 0 || !strings.Contains(stdout.String(), "usage: kvrelay decode --engine") {
		t.Fatalf("code %d, stdout %q", code, stdout.String())
	}
}

// FuzzDecode feeds arbitrary hex lines and raw payloads through the command:
// whatever the bytes, it exits 0 or 2 and never panics, and a failure is one
// line on stderr.
func FuzzDecode(f *testing.F) {
	for _, s := range []string{tsBatchHex, tsChildHex, unknownTagHex, notABatchHex, tsBatchHex[:40], "zz", ""} {
		f.Add(s, true)
		f.Add(string(mustHexF(s)), false)
	}
	f.Fuzz(func(t *testing.T, input string, hexMode bool) {
		args := []string{"decode", "--engine", "sglang"}
		if hexMode {
			args = append(args, "--hex")
		}
		var stdout, stderr bytes.Buffer
		code := dispatch(context.Background(), args, strings.NewReader(input), &stdout, &stderr)
		switch code {
		case 0:
			if stderr.Len() != 0 {
				t.Fatalf("exit 0 with stderr %q", stderr.String())
			}
		case 2:
			if strings.Count(stderr.String(), "\n") != 1 {
				t.Fatalf("exit 2 with stderr %q", stderr.String())
			}
		default:
			t.Fatalf("exit code %d", code)
		}
	})
}

func mustHexF(s string) []byte {
	b, err := hex.DecodeString(s)
	if err != nil {
		return []byte(s)
	}
	return b
}

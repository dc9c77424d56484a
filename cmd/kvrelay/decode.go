package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/hex"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"math"
	"os"
	"strings"

	"google.golang.org/protobuf/encoding/protojson"

	"github.com/kvrelay/kvrelay/engines/wire"
	"github.com/kvrelay/kvrelay/relayd"
)

func init() {
	register("decode", "decode engine KV-event payloads (msgpack) into normalized batches (JSON)", runDecode)
}

func printDecodeUsage(fs *flag.FlagSet) {
	w := fs.Output()
	fmt.Fprintln(w, "usage: kvrelay decode --engine vllm|sglang|tokenspeed [--hex] [--seq N] [--rank R] [FILE]")
	fmt.Fprintln(w, "\nReads one raw msgpack payload (with --hex: one hex payload per line, blank lines")
	fmt.Fprintln(w, "skipped) from FILE or stdin (\"-\" too), normalizes it as kvrelay does, and prints one")
	fmt.Fprintln(w, `line per payload: {"batch": <KvEventBatch as protojson>, "drops": {"<reason>": n}}.`)
	fmt.Fprintln(w, "Payloads share one normalizer, so state carries from line to line as in a stream.")
	fmt.Fprintln(w, "Exit status: 0 when every payload decoded; 2 on a bad flag or at the first payload that")
	fmt.Fprintln(w, "is not a batch (bad hex, truncated or invalid msgpack), after printing those before it.")
	fmt.Fprintln(w, "\nflags:")
	fs.PrintDefaults()
}

// runDecode exits 0 when every payload decoded, 2 on a bad flag or the first
// payload that is not a batch (after printing the ones before it).
func runDecode(_ context.Context, args []string, stdin io.Reader, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("decode", flag.ContinueOnError)
	engine := fs.String("engine", "", "the publishing engine: vllm, sglang or tokenspeed (required)")
	hexLines := fs.Bool("hex", false, "the input is hex, one payload per line")
	seq := fs.Uint64("seq", 0, "sequence number of the first payload; each further payload gets the next")
	rank := fs.Int64("rank", -1, "the socket's DP rank, which wins over the payload's; -1: use the payload's")
	if code, stop := parseFlagsUsage(fs, args, stdout, stderr, func() { printDecodeUsage(fs) }); stop {
		return code
	}
	if *engine == "" {
		fmt.Fprintln(stderr, "kvrelay decode: --engine is required: vllm, sglang or tokenspeed")
		return 2
	}
	eng, err := relayd.EngineByName(*engine)
	if err != nil {
		fmt.Fprintf(stderr, "kvrelay decode: --engine %q: want vllm, sglang or tokenspeed\n", *engine)
		return 2
	}
	dialect := eng.Dialect
	if *rank < -1 || *rank > math.MaxInt32 {
		fmt.Fprintf(stderr, "kvrelay decode: --rank %d: want -1 or a rank from 0 to %d\n", *rank, math.MaxInt32)
		return 2
	}
	if fs.NArg() > 1 {
		fmt.Fprintf(stderr, "kvrelay decode: one FILE at most, got %d: %s\n", fs.NArg(), strings.Join(fs.Args(), " "))
		return 2
	}

	input, name := stdin, "stdin"
	if fs.NArg() == 1 && fs.Arg(0) != "-" {
		name = fs.Arg(0)
		f, err := os.Open(name)
		if err != nil {
			fmt.Fprintf(stderr, "kvrelay decode: %v\n", err)
			return 2
		}
		defer f.Close()
		input = f
	}

	d := &payloadDecoder{
		normalizer: wire.NewNormalizer(dialect),
		seq:        *seq,
		rank:       int32(*rank),
		out:        bufio.NewWriter(stdout),
	}
	if *hexLines {
		err = d.hexLines(input)
	} else {
		err = d.raw(input, name)
	}
	if flushErr := d.out.Flush(); err == nil && flushErr != nil {
		err = fmt.Errorf("writing output: %w", flushErr)
	}
	if err != nil {
		fmt.Fprintf(stderr, "kvrelay decode: %v\n", err)
		return 2
	}
	return 0
}

type payloadDecoder struct {
	normalizer *wire.Normalizer
	seq        uint64
	rank       int32
	out        *bufio.Writer
}

func (d *payloadDecoder) raw(r io.Reader, name string) error {
	payload, err := io.ReadAll(r)
	if err != nil {
		return fmt.Errorf("reading %s: %w", name, err)
	}
	if err := d.payload(payload); err != nil {
		return fmt.Errorf("%s: %w", name, err)
	}
	return nil
}

func (d *payloadDecoder) hexLines(r io.Reader) error {
	br := bufio.NewReader(r)
	for line := 1; ; line++ {
		text, readErr := br.ReadString('\n')
		if readErr != nil && readErr != io.EOF {
			return fmt.Errorf("line %d: reading input: %w", line, readErr)
		}
		if trimmed := strings.TrimSpace(text); trimmed != "" {
			payload, err := decodeHexLine(trimmed)
			if err != nil {
				return fmt.Errorf("line %d: %w", line, err)
			}
			if err := d.payload(payload); err != nil {
				return fmt.Errorf("line %d: %w", line, err)
			}
		}
		if readErr == io.EOF {
			return nil
		}
	}
}

// decodeHexLine names the offset of the first character that is not hex, so
// a user can find it in a long line.
func decodeHexLine(s string) ([]byte, error) {
	for i := 0; i < len(s); i++ {
		c := s[i]
		if !('0' <= c && c <= '9' || 'a' <= c && c <= 'f' || 'A' <= c && c <= 'F') {
			return nil, fmt.Errorf("bad hex at byte %d: %q is not a hex digit", i, c)
		}
	}
	if len(s)%2 != 0 {
		return nil, fmt.Errorf("bad hex at byte %d: odd number of hex digits (%d)", len(s), len(s))
	}
	return hex.DecodeString(s)
}

func (d *payloadDecoder) payload(payload []byte) error {
	batch, drops, err := d.normalizer.Normalize(payload, d.seq, d.rank)
	if err != nil {
		return err
	}
	d.seq++
	pj, err := protojson.Marshal(batch)
	if err != nil {
		return fmt.Errorf("encoding the batch: %w", err)
	}
	// protojson randomizes its whitespace; compacting makes the output
	// byte-stable, so it can be diffed and compared in scripts.
	var compact bytes.Buffer
	if err := json.Compact(&compact, pj); err != nil {
		return fmt.Errorf("compacting the batch: %w", err)
	}
	dj, err := json.Marshal(drops)
	if err != nil {
		return fmt.Errorf("encoding the drops: %w", err)
	}
	d.out.WriteString(`{"batch":`)
	d.out.Write(compact.Bytes())
	d.out.WriteString(`,"drops":`)
	d.out.Write(dj)
	d.out.WriteString("}\n")
	return nil
}

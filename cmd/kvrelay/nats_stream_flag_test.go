package main

import (
	"flag"
	"strings"
	"testing"
)

// TestServeNATSFlagsNeedNATS: every sink flag given without --nats is
// refused, naming it, as --nats-events-subject-prefix and
// --nats-alive-every are; --nats-stream alone was taken and ignored, so a
// relay meant for a stream published nowhere without a word.
func TestServeNATSFlagsNeedNATS(t *testing.T) {
	for _, args := range [][]string{
		{"--nats-stream", "GROUP_A"},
		{"--nats-events-subject-prefix", "group-a.events"},
		{"--nats-alive-every", "2s"},
	} {
		fs := flag.NewFlagSet("serve", flag.ContinueOnError)
		f := addServeNATSFlags(fs)
		if err := fs.Parse(args); err != nil {
			t.Fatal(err)
		}
		err := f.check()
		if err == nil || !strings.Contains(err.Error(), args[0]+" needs --nats") {
			t.Errorf("%v without --nats: %v, want %q", args, err, args[0]+" needs --nats")
		}
	}
}

package relay

import (
	"errors"
	"log/slog"
	"testing"

	"google.golang.org/protobuf/proto"

	"github.com/kvrelay/kvrelay/proto/kvpb"
)

// The relay writes each batch's wire bytes straight from the decoder. A
// batch that decodes but holds a string proto3 cannot carry (a LoRA name
// that is not valid UTF-8) cannot be written; it is relayed empty under its
// sequence, logged as an error, not counted as undecodable, and the record
// does not take its blocks: the stream and the record stay in step.
func TestABatchThatCannotBeEncodedIsRelayedEmpty(t *testing.T) {
	rec := &logRecorder{}
	l := newLab(t, labOpts{noReplay: true, beforeRun: func(l *lab) { l.r.log = slog.New(rec) }})
	s := l.subscribe(0)
	defer s.Close()
	p := l.pubs[0]

	badLora := stored(-1, 20, 21)
	badLora[7] = "lora-\xff" // lora_name: not valid UTF-8
	p.publish(payload(0, stored(-1, 10, 11)))
	p.publish(payload(0, badLora))
	p.publish(payload(0, stored(11, 12)))
	l.cursor(0, 2) // the publisher numbers from 0

	var got []*kvpb.KvEventBatch
	for len(got) < 3 {
		got = append(got, next(t, s))
	}
	for i, want := range []string{"[10 11]", "", "[12]"} {
		if g := storedHashes(got[i]); g != want {
			t.Errorf("batch %d (seq %d) stores %q, want %q", i, got[i].GetSequenceNumber(), g, want)
		}
		if got[i].GetSequenceNumber() != uint64(i) || got[i].GetDpRank() != 0 || got[i].DpRank == nil {
			t.Errorf("batch %d is %s, want rank 0 seq %d", i, describe(got[i]), i)
		}
	}
	if len(got[1].GetEvents()) != 0 {
		t.Errorf("the unencodable batch was relayed with %d events, want none", len(got[1].GetEvents()))
	}
	if n := counter(l.m().undecodable.WithLabelValues("0")); n != 0 {
		t.Errorf("%v undecodable batches counted, want 0: the payload decoded", n)
	}
	if n := rec.count(slog.LevelError, "encoding a relayed batch failed"); n != 1 {
		t.Errorf("%d errors logged for the unencodable batch, want 1", n)
	}
	// The record holds what the stream said: 10, 11 and 12, not 20 or 21.
	if _, blocks, _ := l.r.rec.stats(); blocks != 3 {
		t.Errorf("the record holds %d blocks, want the 3 the stream relayed", blocks)
	}
	if n := counter(l.m().blocks.WithLabelValues("0")); n != 3 {
		t.Errorf("kvrelay_blocks counted %v, want 3", n)
	}
}

// failingRecord is the relay's record with applyEncoded failing for the
// sequences in fail (the record's refusal of the relay's own bytes, which
// cannot happen with the real record: a defect's path, kept safe).
type failingRecord struct {
	liveRecord
	fail map[uint64]bool
}

func (f failingRecord) applyEncoded(enc []byte) (applied, error) {
	b := &kvpb.KvEventBatch{}
	if err := proto.Unmarshal(enc, b); err != nil {
		return applied{}, err
	}
	if f.fail[b.GetSequenceNumber()] {
		return applied{}, errors.New("refused for the test")
	}
	return f.liveRecord.applyEncoded(enc)
}

// A batch the record refuses is relayed empty under its sequence, and its
// bytes stay its own: the rank's encoding buffer, reused by the next batch,
// must not be what the history and the subscribers hold.
func TestABatchTheRecordRefusesIsRelayedEmptyAndKeepsItsBytes(t *testing.T) {
	l := newLab(t, labOpts{noReplay: true, beforeRun: func(l *lab) {
		l.r.log = quietLogger()
		l.r.rec = failingRecord{liveRecord: l.r.rec, fail: map[uint64]bool{0: true}}
	}})
	p := l.pubs[0]
	p.publish(payload(0, stored(-1, 10, 11)))
	p.publish(payload(0, stored(-1, 20, 21, 22, 23)))
	l.cursor(0, 1)
	for _, sub := range []*Subscription{l.subscribe(0), l.subscribe(0)} { // history, twice
		b0, b1 := next(t, sub), next(t, sub)
		if got := describe(b0) + " " + describe(b1); got != "0:0 0:1" {
			t.Fatalf("batches %s, want 0:0 0:1", got)
		}
		if h := storedHashes(b0, b1); h != "[20 21 22 23]" {
			t.Fatalf("stores %q, want only the second batch's", h)
		}
		sub.Close()
	}
}

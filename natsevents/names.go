package natsevents

import (
	"fmt"
	"math"
	"strconv"
	"strings"

	"github.com/zeebo/xxh3"

	"github.com/kvrelay/kvrelay/proto/kvpb"
)

// Defaults shared by the sink and the source.
const (
	DefaultStream        = "KVRELAY_EVENTS"
	DefaultSubjectPrefix = "kvrelay.events"
)

// BucketFor is the object store bucket holding a stream's snapshots.
func BucketFor(stream string) string { return stream + "_SNAPSHOTS" }

// WorkerToken makes a worker name one subject token, injectively: letters,
// digits, '-' and '_' stay, every other byte becomes %XX. "10.0.0.1:50061"
// is 10%2E0%2E0%2E1%3A50061. Dots would split the token, and '*', '>' and
// white space are not allowed in subjects at all.
func WorkerToken(worker string) string {
	var b strings.Builder
	for i := 0; i < len(worker); i++ {
		c := worker[i]
		switch {
		case c >= 'a' && c <= 'z', c >= 'A' && c <= 'Z', c >= '0' && c <= '9', c == '-', c == '_':
			b.WriteByte(c)
		default:
			fmt.Fprintf(&b, "%%%02X", c)
		}
	}
	return b.String()
}

// checkName refuses a stream name or subject prefix that NATS would reject
// or read as more than intended.
func checkSubjectPrefix(p string) error {
	if p == "" || strings.ContainsAny(p, " \t\r\n*>") || strings.HasPrefix(p, ".") || strings.HasSuffix(p, ".") || strings.Contains(p, "..") {
		return fmt.Errorf("subject prefix %q: want dot-separated tokens without wildcards or white space", p)
	}
	return nil
}

func checkStreamName(n string) error {
	if n == "" || strings.ContainsAny(n, " \t\r\n.*>/\\") {
		return fmt.Errorf("stream name %q: want a name without white space, '.', '*', '>', '/' or '\\'", n)
	}
	return nil
}

// rankSubject is where one rank's batches of one worker go.
func rankSubject(prefix, token string, rank int32) string {
	return prefix + "." + token + "." + strconv.Itoa(int(rank))
}

// workerFilter matches every rank's subject of one worker.
func workerFilter(prefix, token string) string { return prefix + "." + token + ".*" }

// msgID names an engine batch for JetStream's duplicate window, the same
// for the same batch whichever relay run publishes it: worker, rank, the
// engine's sequence number and the engine's own timestamp of the batch
// (engines stamp every batch; a restarted engine counts from 0 again at a
// later time, so its batches get other ids). A batch without a stamp is
// told apart by a hash of its bytes instead.
func msgID(token string, b *kvpb.KvEventBatch, enc []byte) string {
	id := token + "." + strconv.Itoa(int(b.GetDpRank())) + "." + strconv.FormatUint(b.GetSequenceNumber(), 10) + "."
	if ts := b.GetTimestamp(); ts != 0 {
		return id + "t" + strconv.FormatUint(math.Float64bits(ts), 16)
	}
	return id + "h" + strconv.FormatUint(xxh3.Hash(enc), 16)
}

// streamDefaults fills an empty stream name and subject prefix with the
// defaults and checks both: the sink and the source must agree on them.
func streamDefaults(stream, prefix string) (string, string, error) {
	if stream == "" {
		stream = DefaultStream
	}
	if prefix == "" {
		prefix = DefaultSubjectPrefix
	}
	if err := checkStreamName(stream); err != nil {
		return stream, prefix, fmt.Errorf("natsevents: %w", err)
	}
	if err := checkSubjectPrefix(prefix); err != nil {
		return stream, prefix, fmt.Errorf("natsevents: %w", err)
	}
	return stream, prefix, nil
}

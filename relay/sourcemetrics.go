package relay

import (
	"github.com/prometheus/client_golang/prometheus"
)

// sourceStats are what a rank's ZeroMQ subscriber counts itself, below the
// relay: messages it skipped or dropped before admission ever saw them.
type sourceStats struct {
	received, short, badSequence, dropped, oversized, reconnects uint64
	queuedBytes                                                  int64
}

// replayBoundStats count replays cut short by a bound.
type replayBoundStats struct {
	oversized, outOfRange, tooMany, tooBig, tooLong uint64
}

// The optional interfaces a Feed and a Replayer implement when they count
// such things (the ZeroMQ ones do; tests' in-memory ones need not).
type (
	feedStatser     interface{ sourceStats() sourceStats }
	replayerStatser interface{ replayStats() replayBoundStats }
)

// sourceCollector exports the counters the ranks' sockets keep, read at
// scrape time so the receive path pays nothing for them.
type sourceCollector struct {
	r                                       *Relay
	received, malformed, dropped, oversized *prometheus.Desc
	reconnects, queued, replayCut           *prometheus.Desc
}

func newSourceCollector(r *Relay, labels prometheus.Labels) *sourceCollector {
	desc := func(name, help string, vars ...string) *prometheus.Desc {
		return prometheus.NewDesc(name, help, vars, labels)
	}
	return &sourceCollector{
		r:          r,
		received:   desc("kvrelay_zmq_messages_received_total", "Well-formed live messages read off a rank's socket (including those then dropped).", "rank"),
		malformed:  desc("kvrelay_zmq_malformed_messages_total", "Live messages skipped before admission, by reason: frames (fewer than 3), sequence (unreadable sequence frame).", "rank", "reason"),
		dropped:    desc("kvrelay_zmq_queue_dropped_total", "Live messages dropped because the rank's incoming queue was full (messages or bytes); the sequence gap then asks the replay.", "rank"),
		oversized:  desc("kvrelay_zmq_oversized_messages_total", "Connections closed because the peer declared a frame or message over --max-message-bytes, by socket (live, replay).", "rank", "socket"),
		reconnects: desc("kvrelay_zmq_reconnects_total", "Connections to a rank's publisher made after the first.", "rank"),
		queued:     desc("kvrelay_zmq_queue_bytes", "Bytes held in a rank's incoming queue.", "rank"),
		replayCut:  desc("kvrelay_replays_cut_total", "Replays ended by a bound, by bound (out_of_range, count, bytes, time).", "rank", "bound"),
	}
}

func (c *sourceCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{c.received, c.malformed, c.dropped, c.oversized, c.reconnects, c.queued, c.replayCut} {
		ch <- d
	}
}

func (c *sourceCollector) Collect(ch chan<- prometheus.Metric) {
	counter := func(d *prometheus.Desc, v uint64, labels ...string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.CounterValue, float64(v), labels...)
	}
	for _, rk := range c.r.ranks {
		if box := rk.feed.Load(); box != nil {
			if f, ok := box.Feed.(feedStatser); ok {
				st := f.sourceStats()
				counter(c.received, st.received, rk.label)
				counter(c.malformed, st.short, rk.label, "frames")
				counter(c.malformed, st.badSequence, rk.label, "sequence")
				counter(c.dropped, st.dropped, rk.label)
				counter(c.oversized, st.oversized, rk.label, "live")
				counter(c.reconnects, st.reconnects, rk.label)
				ch <- prometheus.MustNewConstMetric(c.queued, prometheus.GaugeValue, float64(st.queuedBytes), rk.label)
			}
		}
		if rep, ok := rk.replayStatser(); ok {
			st := rep.replayStats()
			counter(c.oversized, st.oversized, rk.label, "replay")
			counter(c.replayCut, st.outOfRange, rk.label, "out_of_range")
			counter(c.replayCut, st.tooMany, rk.label, "count")
			counter(c.replayCut, st.tooBig, rk.label, "bytes")
			counter(c.replayCut, st.tooLong, rk.label, "time")
		}
	}
}

package relay

// Status is the relay's state for /debug/status. Optional numbers are
// pointers so that "none yet" reads as null, not as 0 (0 is a sequence).
type Status struct {
	Engine        string       `json:"engine"`
	Enabled       bool         `json:"enabled"`
	Ready         bool         `json:"ready"`
	Generation    uint64       `json:"generation"`
	Relayed       uint64       `json:"relayed"`
	Subscribers   int          `json:"subscribers"`
	RecordBlocks  uint64       `json:"record_blocks"`
	RecordEntries uint64       `json:"record_entries"`
	History       HistoryState `json:"history"`
	Ranks         []RankStatus `json:"ranks"`
}

// HistoryState describes the interleaved history log.
type HistoryState struct {
	Entries    int    `json:"entries"`
	Bytes      int64  `json:"bytes"`
	Holes      int    `json:"holes"`
	MaxEntries int    `json:"max_entries"`
	MaxBytes   int64  `json:"max_bytes"`
	FirstPos   uint64 `json:"first_position"`
	LastPos    uint64 `json:"last_position"`
}

// RankStatus is one DP rank.
type RankStatus struct {
	Rank           int32   `json:"rank"`
	Endpoint       string  `json:"endpoint"`
	ReplayEndpoint string  `json:"replay_endpoint,omitempty"`
	Connected      bool    `json:"connected"`
	Cursor         *uint64 `json:"cursor"`
	StartedAt      *uint64 `json:"started_at"`
	WindowFirst    *uint64 `json:"window_first"`
	WindowLast     *uint64 `json:"window_last"`
	Holes          int     `json:"holes"`
	HoleSequences  uint64  `json:"hole_sequences"`
	UnknownBefore  uint64  `json:"unknown_before"`
	Restarts       uint64  `json:"restarts"`
	RecordBlocks   uint64  `json:"record_blocks"`
}

// Status reports the relay's state; it takes the admission lock briefly.
func (r *Relay) Status() Status {
	st := Status{Engine: r.cfg.Engine.Name, Enabled: r.cfg.KV.Enabled, Ready: r.Ready()}
	r.mu.Lock()
	defer r.mu.Unlock()
	perRank, blocks, entries := r.rec.stats()
	st.Generation = r.generation
	st.Relayed = r.relayed
	st.Subscribers = len(r.subs)
	st.RecordBlocks, st.RecordEntries = blocks, entries
	st.History = HistoryState{
		Entries: r.hist.len(), Bytes: r.hist.bytes, Holes: r.hist.holes,
		MaxEntries: r.hist.maxEntries, MaxBytes: r.hist.maxBytes,
		FirstPos: r.hist.firstPos(), LastPos: r.hist.tip(),
	}
	for _, rk := range r.ranks {
		rs := RankStatus{
			Rank: rk.rank, Endpoint: rk.endpoint, ReplayEndpoint: rk.replayEndpoint,
			UnknownBefore: rk.unknownBefore, Restarts: rk.restarts, RecordBlocks: perRank[rk.rank],
		}
		if f := rk.feed.Load(); f != nil {
			rs.Connected = f.Connected()
		}
		if rk.hasCursor {
			rs.Cursor = ptr(rk.cursor)
		}
		if rk.hasStart {
			rs.StartedAt = ptr(rk.startedAt)
		}
		if first, last, ok := r.hist.rankBounds(rk.rank); ok {
			rs.WindowFirst, rs.WindowLast = ptr(first), ptr(last)
		}
		if w := r.hist.ranks[rk.rank]; w != nil {
			rs.Holes, rs.HoleSequences = w.holes, w.holeSeqs
		}
		st.Ranks = append(st.Ranks, rs)
	}
	return st
}

func ptr[T any](v T) *T { return &v }

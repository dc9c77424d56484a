package relayd

import (
	"fmt"
	"io"
	"slices"
	"strings"
	"text/tabwriter"

	"github.com/kvrelay/kvrelay/relay"
)

// RelayStatus is one relay's entry in /debug/status, which maps relay names
// to them: a relay whose engine's events are off has no listener or status.
type RelayStatus struct {
	Engine  string        `json:"engine"`
	Enabled bool          `json:"enabled"`
	Listen  string        `json:"listen,omitempty"`
	Status  *relay.Status `json:"status,omitempty"`
}

// WriteStatusTable renders /debug/status for a person (kvrelay status): one
// line per relay, then one per rank with its cursor, window and holes.
func WriteStatusTable(w io.Writer, all map[string]RelayStatus) error {
	names := make([]string, 0, len(all))
	for n := range all {
		names = append(names, n)
	}
	slices.Sort(names)
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "RELAY\tENGINE\tLISTEN\tREADY\tRELAYED\tSUBSCRIBERS\tHISTORY\tHOLES\tRECORD BLOCKS")
	for _, n := range names {
		r := all[n]
		if r.Status == nil {
			fmt.Fprintf(tw, "%s\t%s\t-\tevents off\t-\t-\t-\t-\t-\n", n, r.Engine)
			continue
		}
		s := r.Status
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%d\t%d\t%d batches, %s\t%d\t%d\n", n, r.Engine, r.Listen, yesNo(s.Ready),
			s.Relayed, s.Subscribers, s.History.Entries, byteSize(s.History.Bytes), s.History.Holes, s.RecordBlocks)
	}
	fmt.Fprintln(tw)
	fmt.Fprintln(tw, "RELAY\tRANK\tENDPOINT\tCONNECTED\tCURSOR\tWINDOW\tHOLES\tUNKNOWN BEFORE\tRESTARTS")
	for _, n := range names {
		if all[n].Status == nil {
			continue
		}
		for _, rk := range all[n].Status.Ranks {
			window := "-"
			if rk.WindowFirst != nil && rk.WindowLast != nil {
				window = fmt.Sprintf("%d..%d", *rk.WindowFirst, *rk.WindowLast)
			}
			holes := fmt.Sprint(rk.Holes)
			if rk.Holes > 0 {
				holes += fmt.Sprintf(" (%d seqs)", rk.HoleSequences)
			}
			fmt.Fprintf(tw, "%s\t%d\t%s\t%s\t%s\t%s\t%s\t%d\t%d\n", n, rk.Rank, rk.Endpoint, yesNo(rk.Connected),
				optSeq(rk.Cursor), window, holes, rk.UnknownBefore, rk.Restarts)
		}
	}
	return tw.Flush()
}

func yesNo(b bool) string {
	if b {
		return "yes"
	}
	return "no"
}

func optSeq(p *uint64) string {
	if p == nil {
		return "-"
	}
	return fmt.Sprint(*p)
}

// byteSize is n in the largest binary unit that keeps it ≥ 1.
func byteSize(n int64) string {
	const unit = 1024
	if n < unit {
		return fmt.Sprintf("%d B", n)
	}
	v, i := float64(n), 0
	for v >= unit && i < 4 {
		v /= unit
		i++
	}
	return fmt.Sprintf("%.1f %s", v, strings.Fields("B KiB MiB GiB TiB")[i])
}

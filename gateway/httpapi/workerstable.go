package httpapi

import (
	"fmt"
	"io"
	"strings"
	"text/tabwriter"

	"github.com/kvrelay/kvrelay/gateway"
)

// Workers is the body of GET /v1/workers.
type Workers struct {
	Workers []gateway.WorkerStatus `json:"workers"`
}

// WriteWorkersTable renders /v1/workers for a person (kvrelay status): one
// line per worker with its stream's state, cursors, index and load, and the
// last error in full below the table (it is often long: a relay's message).
func WriteWorkersTable(w io.Writer, ws Workers) error {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "WORKER\tMODEL\tSERVICE\tSTATE\tCURSORS\tINDEX BLOCKS\tIN FLIGHT")
	var errs []string
	for _, st := range ws.Workers {
		cursors := make([]string, 0, len(st.Ranks))
		for _, r := range st.Ranks {
			c := "-"
			if r.HasCursor {
				c = fmt.Sprint(r.Cursor)
			}
			if r.Degraded {
				c += " (degraded)"
			}
			cursors = append(cursors, fmt.Sprintf("%d:%s", r.Rank, c))
		}
		if len(cursors) == 0 {
			cursors = append(cursors, "-")
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%d\t%d\n", st.ID, st.Model, st.Service, st.State, strings.Join(cursors, ","), st.IndexBlocks, st.Inflight)
		if st.LastError != "" {
			errs = append(errs, fmt.Sprintf("%s: %s", st.ID, st.LastError))
		}
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	if len(errs) > 0 {
		fmt.Fprintln(w, "\nlast errors:")
		for _, e := range errs {
			fmt.Fprintln(w, "  "+e)
		}
	}
	return nil
}

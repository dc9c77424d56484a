package sim

import (
	"bufio"
	"bytes"
	"context"
	"os"
	"regexp"
	"slices"
	"strings"
	"testing"
)

// readmeFaultKinds returns the kinds in the README's fault table: the rows
// under its "| kind | flag at start |" header, up to the first line that is
// not a table row. Other tables of the README start their rows the same way,
// so the header anchors the search.
func readmeFaultKinds(t *testing.T) []string {
	t.Helper()
	readme, err := os.ReadFile("../README.md")
	if err != nil {
		t.Fatalf("the README documents the fault kinds: %v", err)
	}
	row := regexp.MustCompile("^\\| `([a-z_]+)` \\|")
	var kinds []string
	inTable := false
	sc := bufio.NewScanner(bytes.NewReader(readme))
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		switch {
		case strings.HasPrefix(line, "| kind | flag at start |"):
			inTable = true
		case inTable && !strings.HasPrefix(line, "|"):
			return kinds
		case inTable:
			if m := row.FindStringSubmatch(line); m != nil {
				kinds = append(kinds, m[1])
			}
		}
	}
	if !inTable {
		t.Fatal(`README.md has no fault table (a "| kind | flag at start |" header)`)
	}
	return kinds
}

// TestREADMEListsEveryFaultKind keeps the README's fault table in step with
// the simulator, both ways: each kind the engine names in its unknown-kind
// error (the list a user is shown) has a row, and each row's kind is
// accepted by Fault.
func TestREADMEListsEveryFaultKind(t *testing.T) {
	e, err := Start(context.Background(), Options{Engine: "vllm", BlockSize: 4,
		KVEventsConfig: `{"enable_kv_cache_events": true, "endpoint": "inproc://readme", "replay_endpoint": "inproc://readme-replay"}`})
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()

	unknown := e.Fault(Fault{Kind: "no_such_kind"})
	if unknown == nil {
		t.Fatal("an unknown fault kind was accepted")
	}
	m := regexp.MustCompile(`\(want ([a-z_, ]+) or ([a-z_]+)\)`).FindStringSubmatch(unknown.Error())
	if m == nil {
		t.Fatalf("the unknown-kind error lists no kinds: %v", unknown)
	}
	named := append(strings.Split(m[1], ", "), m[2])

	documented := readmeFaultKinds(t)
	for _, k := range named {
		if !slices.Contains(documented, k) {
			t.Errorf("fault kind %q is not in the README's fault table %v", k, documented)
		}
	}
	for _, k := range documented {
		if !slices.Contains(named, k) {
			t.Errorf("the README documents fault kind %q, which the simulator does not name (%v)", k, named)
		}
		if err := e.Fault(Fault{Kind: FaultKind(k)}); err != nil {
			t.Errorf("the README's fault kind %q is refused: %v", k, err)
		}
	}
}

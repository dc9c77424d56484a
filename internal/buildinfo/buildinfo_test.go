package buildinfo

import (
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
)

func TestString(t *testing.T) {
	cases := []struct {
		info Info
		want string
	}{
		{Info{Version: "(devel)", GoVersion: "go1.27.3"}, "kvrelay (devel) go1.27.3"},
		{Info{Version: "v1.2.0", Revision: "abc123", Time: "2026-12-03T08:00:00Z", GoVersion: "go1.27.3"},
			"kvrelay v1.2.0 (abc123, 2026-12-03T08:00:00Z) go1.27.3"},
		{Info{Version: "(devel)", Revision: "abc123", Modified: true, GoVersion: "go1.27.3"},
			"kvrelay (devel) (abc123-dirty) go1.27.3"},
	}
	for _, tc := range cases {
		if got := tc.info.String(); got != tc.want {
			t.Errorf("%+v: got %q, want %q", tc.info, got, tc.want)
		}
	}
}

func TestReadHonoursTheLinkerOverride(t *testing.T) {
	old := Version
	t.Cleanup(func() { Version = old })
	Version = "v9.9.9"
	info := Read()
	if info.Version != "v9.9.9" {
		t.Fatalf("Version = %q, want the -X override", info.Version)
	}
	if !strings.HasPrefix(info.GoVersion, "go") {
		t.Fatalf("GoVersion = %q", info.GoVersion)
	}
}

func TestCollector(t *testing.T) {
	reg := prometheus.NewPedanticRegistry()
	reg.MustRegister(Info{Version: "v1.2.0", Revision: "abc", GoVersion: "go1.27.3"}.Collector())
	want := `# HELP kvrelay_build_info Always 1; labels name the kvrelay build (version, VCS revision, Go version).
# TYPE kvrelay_build_info gauge
kvrelay_build_info{goversion="go1.27.3",revision="abc",version="v1.2.0"} 1
`
	if err := testutil.GatherAndCompare(reg, strings.NewReader(want)); err != nil {
		t.Fatal(err)
	}
}

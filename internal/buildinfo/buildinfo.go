// Package buildinfo says which kvrelay a binary is: its version, the VCS
// revision it was built from and the Go toolchain, as the Go linker stamps
// them (runtime/debug.ReadBuildInfo, -buildvcs), for `kvrelay version` and
// the kvrelay_build_info metric.
package buildinfo

import (
	"fmt"
	"runtime/debug"

	"github.com/prometheus/client_golang/prometheus"
)

// Version overrides the module version for release builds that are not
// built from a module version (`go install …@vX` stamps that by itself):
//
//	go build -ldflags "-X github.com/kvrelay/kvrelay/internal/buildinfo.Version=v1.2.0" ./cmd/kvrelay
var Version = ""

// Info describes one build.
type Info struct {
	Version   string // "v1.2.0", or "(devel)" for a build from a checkout
	Revision  string // VCS commit, "" when the build was not stamped
	Time      string // commit time (RFC 3339), "" when unknown
	Modified  bool   // the work tree had uncommitted changes
	GoVersion string
}

// Read returns this binary's build information.
func Read() Info {
	info := Info{Version: "(devel)"}
	bi, ok := debug.ReadBuildInfo()
	if ok {
		info.GoVersion = bi.GoVersion
		if v := bi.Main.Version; v != "" {
			info.Version = v
		}
		for _, s := range bi.Settings {
			switch s.Key {
			case "vcs.revision":
				info.Revision = s.Value
			case "vcs.time":
				info.Time = s.Value
			case "vcs.modified":
				info.Modified = s.Value == "true"
			}
		}
	}
	if Version != "" {
		info.Version = Version
	}
	return info
}

// String is the one-line form `kvrelay version` prints.
func (i Info) String() string {
	s := "kvrelay " + i.Version
	if i.Revision != "" {
		s += " (" + i.revisionLabel()
		if i.Time != "" {
			s += ", " + i.Time
		}
		s += ")"
	}
	return fmt.Sprintf("%s %s", s, i.GoVersion)
}

// revisionLabel is the revision with "-dirty" for a modified tree, or
// "unknown".
func (i Info) revisionLabel() string {
	if i.Revision == "" {
		return "unknown"
	}
	if i.Modified {
		return i.Revision + "-dirty"
	}
	return i.Revision
}

// Collector is the kvrelay_build_info gauge: always 1, the build in its
// labels, so dashboards can join any series to the version that made it.
func (i Info) Collector() prometheus.Collector {
	g := prometheus.NewGauge(prometheus.GaugeOpts{
		Name: "kvrelay_build_info",
		Help: "Always 1; labels name the kvrelay build (version, VCS revision, Go version).",
		ConstLabels: prometheus.Labels{
			"version":   i.Version,
			"revision":  i.revisionLabel(),
			"goversion": i.GoVersion,
		},
	})
	g.Set(1)
	return g
}

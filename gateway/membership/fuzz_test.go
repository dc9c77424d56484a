package membership

import (
	"strings"
	"testing"
)

// FuzzParseWorkerFile: any file gets workers or an error naming lines,
// never a panic; every worker read parses again from its own text.
func FuzzParseWorkerFile(f *testing.F) {
	for _, s := range []string{
		"grpc://h:1\n# c\ngrpc://h:2,model=m # x\n",
		"\n\n#\n",
		"grpc://h:1,model=a,model=b\ngrpcs://[::1]:9,service=sglang\n",
		"grpc://h:1\r\nnot a worker\n",
		strings.Repeat("x", 2000),
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		ws, err := ParseWorkerFile(b)
		if err != nil {
			if !strings.Contains(err.Error(), "line ") && !strings.Contains(err.Error(), "over 1024 bytes") {
				t.Fatalf("error names no line: %v", err)
			}
			return
		}
		for _, w := range ws {
			back, err := ParseWorker(FormatWorker(w))
			if err != nil || back.ID != w.ID || back.Model != w.Model || back.Service != w.Service {
				t.Fatalf("%+v does not read back: %+v, %v", w, back, err)
			}
		}
	})
}

// FuzzParseDNSSpec: any --worker-dns value gets a spec or an error, and a
// spec has a name and, for A/AAAA, a port.
func FuzzParseDNSSpec(f *testing.F) {
	for _, s := range []string{"e.ns.svc:50051", "srv+_grpc._tcp.e,model=m,tls=true", "e:0", "srv+", "e:1,zone"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		sp, err := ParseDNSSpec(s)
		if err != nil {
			return
		}
		if sp.Name == "" || (!sp.SRV && (sp.Port < 1 || sp.Port > 65535)) || sp.Model == "" || sp.Service == "" {
			t.Fatalf("%q parsed to %+v", s, sp)
		}
	})
}

package main

import (
	"archive/tar"
	"bytes"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
	"github.com/google/go-containerregistry/pkg/v1/validate"
)

// TestBuildWritesARunnableScratchImage builds the image from a small static
// binary and reads the tarball back: valid digests, the entrypoint, the
// unprivileged user, and exactly the files the layer should hold.
func TestBuildWritesARunnableScratchImage(t *testing.T) {
	dir := t.TempDir()
	src := filepath.Join(dir, "main.go")
	if err := os.WriteFile(src, []byte("package main\nfunc main() {}\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	bin := filepath.Join(dir, "kvrelay")
	cmd := exec.Command("go", "build", "-o", bin, src)
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0", "GOOS=linux", "GOFLAGS=")
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	certs := filepath.Join(dir, "ca.pem")
	if err := os.WriteFile(certs, []byte("-----BEGIN CERTIFICATE-----\n-----END CERTIFICATE-----\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	out := filepath.Join(dir, "image.tar")
	created := time.Unix(1700000000, 0).UTC()
	if err := build(options{binary: bin, caCerts: certs, tag: "kvrelay:test", out: out, arch: "amd64", created: created}); err != nil {
		t.Fatal(err)
	}

	tag, _ := name.NewTag("kvrelay:test")
	img, err := tarball.ImageFromPath(out, &tag)
	if err != nil {
		t.Fatal(err)
	}
	if err := validate.Image(img); err != nil {
		t.Fatalf("invalid image: %v", err)
	}
	cfg, err := img.ConfigFile()
	if err != nil {
		t.Fatal(err)
	}
	if got := strings.Join(cfg.Config.Entrypoint, " "); got != "/usr/local/bin/kvrelay" {
		t.Errorf("entrypoint %q", got)
	}
	if cfg.Config.User != "65532:65532" || cfg.OS != "linux" || cfg.Architecture != "amd64" || !cfg.Created.Time.Equal(created) {
		t.Errorf("config: user %q os %q arch %q created %v", cfg.Config.User, cfg.OS, cfg.Architecture, cfg.Created)
	}
	layers, err := img.Layers()
	if err != nil || len(layers) != 1 {
		t.Fatalf("layers: %d, %v", len(layers), err)
	}
	rc, err := layers[0].Uncompressed()
	if err != nil {
		t.Fatal(err)
	}
	defer rc.Close()
	files := map[string]*tar.Header{}
	var binary []byte
	tr := tar.NewReader(rc)
	for {
		h, err := tr.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		files[h.Name] = h
		if h.Name == "usr/local/bin/kvrelay" {
			binary, _ = io.ReadAll(tr)
		}
	}
	want, _ := os.ReadFile(bin)
	if !bytes.Equal(binary, want) || files["usr/local/bin/kvrelay"].Mode != 0o755 {
		t.Errorf("the layer's kvrelay is not the binary given (%d vs %d bytes)", len(binary), len(want))
	}
	for _, f := range []string{"etc/passwd", "etc/group", "etc/ssl/certs/ca-certificates.crt", "tmp/"} {
		if files[f] == nil {
			t.Errorf("layer lacks %s", f)
		}
	}
	if h := files["tmp/"]; h != nil && h.Mode != 0o1777 {
		t.Errorf("/tmp mode %o, want 1777", h.Mode)
	}
}

func TestBuildRefusesADynamicBinary(t *testing.T) {
	sh, err := exec.LookPath("sh")
	if err != nil {
		t.Skip("no sh to stand in for a dynamic binary")
	}
	sh, _ = filepath.EvalSymlinks(sh)
	if err := checkStatic(sh); err == nil || !strings.Contains(err.Error(), "CGO_ENABLED=0") {
		// A static sh (busybox) would pass: then this host has nothing to test with.
		if err == nil {
			t.Skipf("%s is static", sh)
		}
		t.Fatalf("error %v, want one saying how to build a static binary", err)
	}
}

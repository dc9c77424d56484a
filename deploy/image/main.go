// Command image builds kvrelay's container image without a container
// daemon or a base image to pull: an empty ("scratch") image plus one layer
// holding the static kvrelay binary, the CA certificates (for TLS to an
// upstream) and a passwd/group naming the unprivileged user it runs as. The
// result is a `docker save`-style tarball that docker load, podman load,
// skopeo and crane all read.
//
//	CGO_ENABLED=0 go build -o .bin/linux-amd64/kvrelay ./cmd/kvrelay
//	go run ./deploy/image -binary .bin/linux-amd64/kvrelay -tag kvrelay:dev -out .bin/kvrelay-image.tar
//
// `make image` does both.
package main

import (
	"archive/tar"
	"bytes"
	"debug/elf"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
)

// The user the image runs as: distroless's "nonroot" numbers, so volume
// permissions written for those images carry over.
const (
	nonrootUID = 65532
	binaryPath = "/usr/local/bin/kvrelay"
)

// options are the image's inputs.
type options struct {
	binary  string // static linux kvrelay binary
	caCerts string // PEM bundle to ship, "" for none
	tag     string
	out     string
	arch    string
	created time.Time
}

func main() {
	var o options
	flag.StringVar(&o.binary, "binary", "", "static kvrelay binary for linux (CGO_ENABLED=0)")
	flag.StringVar(&o.caCerts, "ca-certs", "/etc/ssl/certs/ca-certificates.crt", "CA bundle to include as /etc/ssl/certs/ca-certificates.crt (empty: none)")
	flag.StringVar(&o.tag, "tag", "kvrelay:dev", "image reference written into the tarball")
	flag.StringVar(&o.out, "out", "kvrelay-image.tar", "tarball to write")
	flag.StringVar(&o.arch, "arch", "amd64", "GOARCH the binary was built for")
	flag.Parse()
	if o.binary == "" {
		fmt.Fprintln(os.Stderr, "image: -binary is required")
		os.Exit(2)
	}
	// Reproducible by default: SOURCE_DATE_EPOCH, else the epoch.
	o.created = time.Unix(0, 0).UTC()
	if s := os.Getenv("SOURCE_DATE_EPOCH"); s != "" {
		var sec int64
		if _, err := fmt.Sscan(s, &sec); err != nil {
			fmt.Fprintf(os.Stderr, "image: SOURCE_DATE_EPOCH %q: %v\n", s, err)
			os.Exit(2)
		}
		o.created = time.Unix(sec, 0).UTC()
	}
	if err := build(o); err != nil {
		fmt.Fprintln(os.Stderr, "image:", err)
		os.Exit(1)
	}
}

func build(o options) error {
	bin, err := os.ReadFile(o.binary)
	if err != nil {
		return fmt.Errorf("binary: %w", err)
	}
	if err := checkStatic(o.binary); err != nil {
		return err
	}
	var certs []byte
	if o.caCerts != "" {
		if certs, err = os.ReadFile(o.caCerts); err != nil {
			return fmt.Errorf("CA certificates: %w (pass -ca-certs '' to build without)", err)
		}
	}
	layerTar, err := rootFS(bin, certs, o.created)
	if err != nil {
		return err
	}
	layer, err := tarball.LayerFromOpener(func() (io.ReadCloser, error) {
		return io.NopCloser(bytes.NewReader(layerTar)), nil
	})
	if err != nil {
		return fmt.Errorf("layer: %w", err)
	}
	img, err := mutate.Append(empty.Image, mutate.Addendum{Layer: layer, History: v1.History{
		Created: v1.Time{Time: o.created}, CreatedBy: "deploy/image: kvrelay binary, CA certificates, passwd",
	}})
	if err != nil {
		return fmt.Errorf("image: %w", err)
	}
	cfg, err := img.ConfigFile()
	if err != nil {
		return err
	}
	cfg = cfg.DeepCopy()
	cfg.OS, cfg.Architecture = "linux", o.arch
	cfg.Created = v1.Time{Time: o.created}
	cfg.Config.Entrypoint = []string{binaryPath}
	cfg.Config.Cmd = []string{"serve", "--help"}
	cfg.Config.User = fmt.Sprintf("%d:%d", nonrootUID, nonrootUID)
	cfg.Config.WorkingDir = "/"
	cfg.Config.Env = []string{"PATH=/usr/local/bin", "SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt"}
	cfg.Config.Labels = map[string]string{
		"org.opencontainers.image.title":       "kvrelay",
		"org.opencontainers.image.description": "KV-cache event relay for cache-aware LLM gateways",
	}
	if img, err = mutate.ConfigFile(img, cfg); err != nil {
		return fmt.Errorf("config: %w", err)
	}
	if img, err = mutate.CreatedAt(img, v1.Time{Time: o.created}); err != nil {
		return fmt.Errorf("config: %w", err)
	}
	ref, err := name.NewTag(o.tag)
	if err != nil {
		return fmt.Errorf("-tag %q: %w", o.tag, err)
	}
	if err := tarball.WriteToFile(o.out, ref, img); err != nil {
		return fmt.Errorf("write %s: %w", o.out, err)
	}
	return nil
}

// checkStatic refuses a binary that needs a dynamic loader: the image has
// none, so such a binary would fail with a bare "no such file or directory".
func checkStatic(path string) error {
	f, err := elf.Open(path)
	if err != nil {
		return fmt.Errorf("binary %s is not a linux ELF executable: %w", path, err)
	}
	defer f.Close()
	for _, p := range f.Progs {
		if p.Type == elf.PT_INTERP {
			return errors.New("binary " + path + " is dynamically linked; build it with CGO_ENABLED=0")
		}
	}
	return nil
}

// rootFS is the layer: the binary, the CA bundle, and the user database.
func rootFS(bin, certs []byte, mtime time.Time) ([]byte, error) {
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	dir := func(name string) error {
		return tw.WriteHeader(&tar.Header{Typeflag: tar.TypeDir, Name: name, Mode: 0o755, ModTime: mtime})
	}
	file := func(name string, mode int64, data []byte) error {
		if err := tw.WriteHeader(&tar.Header{Typeflag: tar.TypeReg, Name: name, Mode: mode, Size: int64(len(data)), ModTime: mtime}); err != nil {
			return err
		}
		_, err := tw.Write(data)
		return err
	}
	passwd := fmt.Sprintf("root:x:0:0:root:/root:/sbin/nologin\nnonroot:x:%d:%d:nonroot:/home/nonroot:/sbin/nologin\n", nonrootUID, nonrootUID)
	group := fmt.Sprintf("root:x:0:\nnonroot:x:%d:\n", nonrootUID)
	steps := []func() error{
		func() error { return dir("etc/") },
		func() error { return file("etc/passwd", 0o644, []byte(passwd)) },
		func() error { return file("etc/group", 0o644, []byte(group)) },
		func() error { return dir("etc/ssl/") },
		func() error { return dir("etc/ssl/certs/") },
		func() error {
			if certs == nil {
				return nil
			}
			return file("etc/ssl/certs/ca-certificates.crt", 0o644, certs)
		},
		func() error { // ipc:// sockets may live here, as on a host
			return tw.WriteHeader(&tar.Header{Typeflag: tar.TypeDir, Name: "tmp/", Mode: 0o1777, ModTime: mtime})
		},
		func() error { return dir("usr/") },
		func() error { return dir("usr/local/") },
		func() error { return dir("usr/local/bin/") },
		func() error { return file("usr/local/bin/kvrelay", 0o755, bin) },
	}
	for _, step := range steps {
		if err := step(); err != nil {
			return nil, fmt.Errorf("layer: %w", err)
		}
	}
	if err := tw.Close(); err != nil {
		return nil, fmt.Errorf("layer: %w", err)
	}
	return buf.Bytes(), nil
}

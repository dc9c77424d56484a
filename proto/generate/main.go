// Command generate compiles proto/smg/*.proto and runs the protoc plugins on
// them, as `protoc --go_out --go-grpc_out` would, without protoc: the
// compiler is bufbuild/protocompile, pinned in go.mod with the plugins, so
// `make proto` needs nothing but Go.
//
// Usage (from the repository root, as the Makefile runs it):
//
//	go run ./proto/generate -I proto -out proto/kvpb \
//	    -plugin .bin/protoc-gen-go -plugin .bin/protoc-gen-go-grpc \
//	    -param module=github.com/kvrelay/kvrelay/proto/kvpb smg/a.proto …
//
// Every plugin gets the same parameter and the same files to generate; the
// files it returns are written under -out.
package main

import (
	"bytes"
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"

	"github.com/bufbuild/protocompile"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protodesc"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/types/pluginpb"
)

// repeated is a flag that may be given several times.
type repeated []string

func (r *repeated) String() string     { return strings.Join(*r, ",") }
func (r *repeated) Set(v string) error { *r = append(*r, v); return nil }

func main() {
	var importPaths, plugins repeated
	flag.Var(&importPaths, "I", "import path (repeatable)")
	flag.Var(&plugins, "plugin", "plugin executable (repeatable)")
	out := flag.String("out", ".", "directory the generated files are written under")
	param := flag.String("param", "", "parameter passed to every plugin")
	flag.Parse()
	if err := run(importPaths, plugins, *out, *param, flag.Args()); err != nil {
		fmt.Fprintln(os.Stderr, "proto/generate:", err)
		os.Exit(1)
	}
}

func run(importPaths, plugins []string, outDir, param string, files []string) error {
	if len(files) == 0 || len(plugins) == 0 {
		return errors.New("want at least one -plugin and one .proto file")
	}
	compiler := protocompile.Compiler{
		Resolver: protocompile.WithStandardImports(&protocompile.SourceResolver{ImportPaths: importPaths}),
		// Comments reach the generated code, as with protoc.
		SourceInfoMode: protocompile.SourceInfoStandard,
	}
	compiled, err := compiler.Compile(context.Background(), files...)
	if err != nil {
		return fmt.Errorf("compile: %w", err)
	}
	req := &pluginpb.CodeGeneratorRequest{FileToGenerate: files}
	if param != "" {
		req.Parameter = proto.String(param)
	}
	// ProtoFile lists every file, imports before the files that use them.
	seen := map[string]bool{}
	var add func(fd protoreflect.FileDescriptor)
	add = func(fd protoreflect.FileDescriptor) {
		if seen[fd.Path()] {
			return
		}
		seen[fd.Path()] = true
		imports := fd.Imports()
		for i := 0; i < imports.Len(); i++ {
			add(imports.Get(i).FileDescriptor)
		}
		req.ProtoFile = append(req.ProtoFile, protodesc.ToFileDescriptorProto(fd))
	}
	for _, f := range compiled {
		add(f)
	}
	for _, plugin := range plugins {
		if err := runPlugin(plugin, req, outDir); err != nil {
			return err
		}
	}
	return nil
}

func runPlugin(plugin string, req *pluginpb.CodeGeneratorRequest, outDir string) error {
	in, err := proto.Marshal(req)
	if err != nil {
		return fmt.Errorf("%s: encoding the request: %w", plugin, err)
	}
	var stdout, stderr bytes.Buffer
	cmd := exec.Command(plugin)
	cmd.Stdin, cmd.Stdout, cmd.Stderr = bytes.NewReader(in), &stdout, &stderr
	if err := cmd.Run(); err != nil {
		return fmt.Errorf("%s: %w: %s", plugin, err, stderr.String())
	}
	var resp pluginpb.CodeGeneratorResponse
	if err := proto.Unmarshal(stdout.Bytes(), &resp); err != nil {
		return fmt.Errorf("%s: decoding the response: %w", plugin, err)
	}
	if resp.Error != nil {
		return fmt.Errorf("%s: %s", plugin, resp.GetError())
	}
	for _, f := range resp.File {
		if f.GetInsertionPoint() != "" {
			return fmt.Errorf("%s: insertion points are not supported (%s)", plugin, f.GetName())
		}
		name := filepath.Clean(f.GetName())
		if filepath.IsAbs(name) || strings.HasPrefix(name, "..") {
			return fmt.Errorf("%s: output path %q leaves the output directory", plugin, f.GetName())
		}
		path := filepath.Join(outDir, name)
		if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
			return err
		}
		if err := os.WriteFile(path, []byte(f.GetContent()), 0o644); err != nil {
			return err
		}
	}
	return nil
}

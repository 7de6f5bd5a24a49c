; One part of the vramguard installer: files only, run silently by the main setup
; (see vramguard.nsi). Generated defines: VERSION, OUTFILE, PART, GEN, COMPRESSOR.

Unicode true
Target x86-unicode  ; the only target stock NSIS for Windows has (see vramguard.nsi)
!if "${COMPRESSOR}" == "none"
  SetCompress off
!else
  SetCompressor /SOLID ${COMPRESSOR}
!endif
CRCCheck force
SilentInstall silent

!include FileFunc.nsh
!include LogicLib.nsh
!include "${__FILEDIR__}/progress.nsh"

Name "vramguard ${VERSION} part ${PART}"
OutFile "${OUTFILE}"
InstallDir "$LOCALAPPDATA\Programs\vramguard"
RequestExecutionLevel user

Function .onInit
  ${GetParameters} $R0
  ClearErrors
  ${GetOptions} $R0 "/FROMSETUP" $R1
  ${If} ${Errors}
    MessageBox MB_ICONINFORMATION "This file is part of the vramguard installer. Run vramguard-${VERSION}-setup.exe (in the same folder) instead."
    Abort
  ${EndIf}
  ClearErrors
  ${GetOptions} $R0 "/PROGRESSBAR=" $ProgressBar
  ${If} ${Errors}
    StrCpy $ProgressBar 0
  ${EndIf}
FunctionEnd

Section
  !include "${GEN}/part-files.nsh"
SectionEnd
